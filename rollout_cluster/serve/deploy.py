"""Deploying the application from a driver (RolloutClient.start, the Ray job): serve.run without
its unbounded wait."""
from __future__ import annotations

import time

from ray import serve

from ..config import ClusterConfig
from .app import replica_options


def deploy(app, cfg: ClusterConfig, timeout_s: float) -> None:
    """Deploy the application, then wait at most timeout_s for Serve to call it RUNNING (every
    replica constructed: engines loaded). A replica that no node can host (more GPUs than any node
    has, say) would leave serve.run waiting forever; here it raises TimeoutError, and a constructor
    that keeps failing raises RuntimeError, each naming what Serve reports and what a replica asks
    for. An application this call created is then removed, as it is when the wait (or Serve's own
    _run) fails or is interrupted (Ctrl-C, or the SIGTERM of `ray job stop`, which Ray turns into
    SystemExit): engines half loaded would hold their GPUs with nobody to use or remove them. One
    that ran before the call (an update of it) is left as Serve has it, and the error says so:
    its drivers and its operator decide."""
    from ray.serve.api import _run
    from ray.serve.schema import ApplicationStatus

    name = cfg.app_name
    # external_scaler_enabled: RolloutClient.scale sets the fleet's size in place (Serve's
    # external scaling API); without it Serve refuses that call.
    deadline = time.monotonic() + timeout_s
    existed = name in serve.status().applications  # (an update: a failed one is left as Serve has it)

    def remove_if_ours() -> None:
        if not existed:
            serve.delete(name)

    try:
        # (_run itself waits for the ingress deployment and every node's proxy, and may raise or
        # be interrupted after the controller took the app)
        _run(app, _blocking=False, name=name, route_prefix=f"/{name}", external_scaler_enabled=True)
        while True:
            status = serve.status().applications.get(name)
            state = status.status if status else None
            if state == ApplicationStatus.RUNNING:
                return
            failed = state == ApplicationStatus.DEPLOY_FAILED
            if failed or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    except BaseException:
        remove_if_ours()
        raise
    reports = [f"{d}: {getattr(ds.status, 'value', ds.status)} {ds.message}".strip()
               for d, ds in (status.deployments.items() if status else ()) if ds.status != "HEALTHY" or ds.message]
    asks = replica_options(cfg)["ray_actor_options"]
    remove_if_ours()
    what = "failed to deploy" if failed else f"was not running after {timeout_s:.0f} s (wait_ready_s)"
    what += (", and was left as Serve has it (it ran before this deploy: an update of it failed)" if existed
             else ", and was removed")
    detail = "; ".join(reports) or (status.message if status else "no status")
    error = RuntimeError if failed else TimeoutError
    raise error(f"Serve application {name!r} {what}. Each EngineReplica asks for "
                f"num_cpus={asks['num_cpus']:g} num_gpus={asks['num_gpus']:g} (resources.*, "
                f"engine.tensor_parallel_size; a replica's GPUs must be on one node). Serve says: {detail}")
