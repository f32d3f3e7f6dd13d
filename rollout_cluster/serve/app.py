"""The Ray Serve application: `serve run rollout_cluster.serve.app:build config=configs/x.yaml`.

The Router is bound into every EngineReplica (replicas pull; the router never addresses a
replica), and a thin Gateway ingress holds both so one application builds the whole graph.
"""
from __future__ import annotations

import json

from ray import serve
from starlette.requests import Request

from ..config import ClusterConfig, load_config, to_dict
from ..batch_follow import check_finish_fraction
from ..protocol import InputError, WeightsVersionError
from .replica import EngineReplica
from .router import Router


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class Gateway:
    """HTTP face of the app (route prefix /<app_name>):
    - GET  /<app>           the router's status as JSON (health checks, dashboards);
    - POST /<app>/generate  a batch in the JSONL format of `rollout-cluster generate` (one request a
      line), answered with the output JSONL once every sequence is done. `?timeout_s=` bounds the
      wait (default 3600); past it the batch is cancelled and the answer is 504. `?weights_version=`
      runs it only on those weights: a fleet on others answers 409. `?finish_fraction=` (and
      `&finish_by=group`) cuts it there: partial rollouts (resume.py).
    For trainers that are not Python; a Python driver uses RolloutClient (streaming, no HTTP limits)."""

    def __init__(self, router, replicas, sampling_defaults: dict = None, call_timeout_s: float = 120.0):
        self.router = router
        self.replicas = replicas
        self.sampling_defaults = sampling_defaults or {}  # the config's `sampling`: what a line leaves out
        self.call_timeout_s = call_timeout_s

    async def __call__(self, request: Request):
        from starlette.responses import JSONResponse

        path = request.url.path.rstrip("/")
        if request.method == "POST" and path.endswith("/generate"):
            return await self._generate(request)
        if request.method != "GET" or path.endswith("/generate"):
            return JSONResponse({"error": f"{request.method} {request.url.path}: use GET / for status, "
                                          "POST /generate for a batch"}, status_code=405)
        return JSONResponse(json.loads(json.dumps(await self.router.status.remote(), default=str)))

    async def _generate(self, request: Request):
        from starlette.responses import JSONResponse, Response

        from ..driver import follow_batch
        from ..jsonl_io import merge_results, read_requests

        try:
            timeout_s = float(request.query_params.get("timeout_s", 3600))
        except ValueError:
            return JSONResponse({"error": f"timeout_s={request.query_params['timeout_s']!r}: not a number"},
                                status_code=400)
        version = request.query_params.get("weights_version")
        if version is not None and not version.isdigit():
            return JSONResponse({"error": f"weights_version={version!r}: must be an integer >= 0"}, status_code=400)
        version = None if version is None else int(version)
        fraction, by = request.query_params.get("finish_fraction"), request.query_params.get("finish_by", "sample")
        try:
            fraction = None if fraction is None else float(fraction)
        except ValueError:
            return JSONResponse({"error": f"finish_fraction={fraction!r}: must be a number in (0, 1]"}, status_code=400)
        try:
            check_finish_fraction(fraction, by)
        except InputError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        lines = (await request.body()).decode("utf-8", errors="replace").splitlines()
        requests, errors = read_requests(lines, self.sampling_defaults)
        results = [None] * len(requests)
        if requests:
            # The router is a deployment of its own: if it restarts, what was not received is
            # submitted again to the new one, as RolloutClient does.
            try:
                async for c in follow_batch(self.router, requests, timeout_s, self.call_timeout_s,
                                            weights_version=version, finish_fraction=fraction, finish_by=by):
                    results[c.index] = c
            except WeightsVersionError as e:  # the fleet runs other weights than the caller trains
                return JSONResponse({"error": str(e)}, status_code=409)
            except TimeoutError as e:
                return JSONResponse({"error": str(e)}, status_code=504)
            except Exception as e:  # no live replica, weights not loadable, batch lost: say why
                return JSONResponse({"error": str(e)}, status_code=503)
        records = merge_results(len(lines), requests, results, errors)
        body = "".join(json.dumps(r) + "\n" for r in records)
        return Response(body, media_type="application/x-ndjson")


QUIET = {"enable_access_log": False}  # pulls run 20 times a second per replica


def replica_options(cfg: ClusterConfig) -> dict:
    opts = {"num_replicas": cfg.replicas, "max_ongoing_requests": 16, "logging_config": QUIET,
            "health_check_period_s": 10, "health_check_timeout_s": 60, "graceful_shutdown_timeout_s": 20}
    opts["ray_actor_options"] = {"num_cpus": cfg.resources.num_cpus, "num_gpus": replica_gpus(cfg)}
    return opts


def replica_gpus(cfg: ClusterConfig) -> float:
    """A replica's Ray GPUs: resources.num_gpus, and at least one per tensor-parallel rank. The
    replica's actor holds them all, so they sit on one node and its CUDA_VISIBLE_DEVICES names
    them; vLLM's multiprocessing executor runs one worker process per rank on them. (In a placement
    group of one-GPU bundles, vLLM picks its Ray executor, which starts in the engine's own
    process: that connects to Ray as a new driver, outside the group, and asks for GPUs the group
    already holds. Ray Serve LLM passes the group to vLLM explicitly for that reason.)"""
    gpus = cfg.resources.num_gpus
    return max(gpus, float(cfg.engine.tensor_parallel_size)) if gpus > 0 else 0.0


def build_app(cfg: ClusterConfig):
    d = to_dict(cfg)
    router = Router.options(max_ongoing_requests=cfg.router.max_ongoing_requests, logging_config=QUIET).bind(d)
    replicas = EngineReplica.options(**replica_options(cfg)).bind(router, d)
    # Each POST /generate holds a Gateway slot until its batch is done: Serve's default of 5 would
    # let five batches block GET / (health checks) and every further batch.
    gateway = Gateway.options(max_ongoing_requests=cfg.router.max_ongoing_requests)
    return gateway.bind(router, replicas, cfg.sampling.spec_fields(), cfg.router.call_timeout_s)


def build(args: dict):
    """Entry point for `serve run` and KubeRay's serveConfigV2: args {config: path} or a config mapping."""
    args = dict(args or {})
    source = args.pop("config", None) or args
    return build_app(load_config(source))
