"""The Ray Serve application: `serve run rollout_cluster.serve.app:build config=configs/x.yaml`.

The Router is bound into every EngineReplica (replicas pull; the router never addresses a
replica), and the HTTP Gateway ingress (gateway.py) holds both so one application builds the
whole graph. deploy.py deploys it from a driver.
"""
from __future__ import annotations

from ..config import ConfigError, ClusterConfig, load_config, to_dict
from .gateway import Gateway
from .replica import EngineReplica
from .router import Router

QUIET = {"enable_access_log": False}  # pulls run 20 times a second per replica
# Serve replaces a replica after 3 failed health checks in a row (a crashed actor after one): at
# Serve's default 10 s period a dead engine or a stalled replica costs ~30 s of capacity before its
# replacement even starts. Our checks read a flag (EngineReplica.check_health) or only ping.
HEALTH_CHECK_PERIOD_S = 2


def replica_options(cfg: ClusterConfig) -> dict:
    # graceful_shutdown_wait_loop_s: a stopping replica first waits this long, then again while
    # requests are ongoing, before its __del__ hands the work back. Replicas pull: Serve routes them
    # no requests, so Serve's default 2 s only delays every hand-back (scale-down, app deletion).
    opts = {"num_replicas": cfg.replicas, "max_ongoing_requests": 16, "logging_config": QUIET,
            "health_check_period_s": HEALTH_CHECK_PERIOD_S, "health_check_timeout_s": 60,
            "graceful_shutdown_wait_loop_s": 0.2, "graceful_shutdown_timeout_s": 20}
    opts["ray_actor_options"] = {"num_cpus": cfg.resources.num_cpus, "num_gpus": replica_gpus(cfg)}
    return opts


def replica_gpus(cfg: ClusterConfig) -> float:
    """A replica's Ray GPUs: resources.num_gpus (a fraction at tensor_parallel_size 1: a GPU shared
    with a trainer), and at least one per rank of a tensor-parallel engine. The
    replica's actor holds them all, so they sit on one node and its CUDA_VISIBLE_DEVICES names
    them; vLLM's multiprocessing executor runs one worker process per rank on them. (In a placement
    group of one-GPU bundles, vLLM picks its Ray executor, which starts in the engine's own
    process: that connects to Ray as a new driver, outside the group, and asks for GPUs the group
    already holds. Ray Serve LLM passes the group to vLLM explicitly for that reason.)"""
    gpus, tp = cfg.resources.num_gpus, cfg.engine.tensor_parallel_size
    return max(gpus, float(tp)) if gpus > 0 and tp > 1 else gpus


def build_app(cfg: ClusterConfig):
    d = to_dict(cfg)
    # a killed router's actor is found dead at its next health check: Serve restarts it then
    router = Router.options(max_ongoing_requests=cfg.router.max_ongoing_requests, logging_config=QUIET,
                            health_check_period_s=HEALTH_CHECK_PERIOD_S).bind(d)
    replicas = EngineReplica.options(**replica_options(cfg)).bind(router, d)
    # Each POST /generate holds a Gateway slot until its batch is done: Serve's default of 5 would
    # let five batches block GET / (health checks) and every further batch.
    # Past max_ongoing_requests Serve queues at most limits.max_queued_requests more, then answers 503.
    gateway = Gateway.options(max_ongoing_requests=cfg.router.max_ongoing_requests,
                              max_queued_requests=cfg.limits.max_queued_requests)
    return gateway.bind(router, replicas, d)


def build(args: dict):
    """Entry point for `serve run` and KubeRay's serveConfigV2: args {config: path} or a config mapping."""
    args = dict(args or {})
    if "config" not in args:
        return build_app(load_config(args))
    source = args.pop("config")
    if not (isinstance(source, str) and source.strip()) or args:
        # an empty path (config=$UNSET) would have deployed every default; keys beside it, ignored
        raise ConfigError(f"config={source!r}" + (f" with {sorted(args)}" if args else "") + ": the app's args are "
                          "either {config: <a YAML file's path>} or the config's keys themselves, not both")
    return build_app(load_config(source))
