"""The Ray Serve application: `serve run rollout_cluster.serve.app:build config=configs/x.yaml`.

The Router is bound into every EngineReplica (replicas pull; the router never addresses a
replica), and a thin Gateway ingress holds both so one application builds the whole graph.
"""
from __future__ import annotations

import json

from ray import serve
from starlette.requests import Request

from ..config import ClusterConfig, load_config, to_dict
from .replica import EngineReplica
from .router import Router


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class Gateway:
    """HTTP face: GET / returns the router's status as JSON (health checks, dashboards)."""

    def __init__(self, router, replicas):
        self.router = router
        self.replicas = replicas

    async def __call__(self, request: Request):
        from starlette.responses import JSONResponse

        return JSONResponse(json.loads(json.dumps(await self.router.status.remote(), default=str)))


QUIET = {"enable_access_log": False}  # pulls run 20 times a second per replica


def replica_options(cfg: ClusterConfig) -> dict:
    tp = cfg.engine.tensor_parallel_size
    opts = {"num_replicas": cfg.replicas, "max_ongoing_requests": 16, "logging_config": QUIET,
            "health_check_period_s": 10, "health_check_timeout_s": 60, "graceful_shutdown_timeout_s": 20}
    if tp > 1 and cfg.resources.num_gpus > 0:
        # vLLM's Ray executor places TP workers into the replica's placement group.
        opts["ray_actor_options"] = {"num_cpus": cfg.resources.num_cpus, "num_gpus": 0}
        opts["placement_group_bundles"] = [{"CPU": cfg.resources.num_cpus}] + [{"GPU": 1}] * tp
        opts["placement_group_strategy"] = "STRICT_PACK"
    else:
        opts["ray_actor_options"] = {"num_cpus": cfg.resources.num_cpus, "num_gpus": cfg.resources.num_gpus}
    return opts


def build_app(cfg: ClusterConfig):
    d = to_dict(cfg)
    router = Router.options(max_ongoing_requests=cfg.router.max_ongoing_requests, logging_config=QUIET).bind(d)
    replicas = EngineReplica.options(**replica_options(cfg)).bind(router, d)
    return Gateway.bind(router, replicas)


def build(args: dict):
    """Entry point for `serve run` and KubeRay's serveConfigV2: args {config: path} or a config mapping."""
    args = dict(args or {})
    source = args.pop("config", None) or args
    return build_app(load_config(source))
