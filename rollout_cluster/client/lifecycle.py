"""How a RolloutClient comes to a fleet and leaves it: `start` starts (or joins) Ray, deploys the
application and waits for its replicas; `connect` joins an app that runs (or appears);
`signed_router` is the router handle its calls go out through; `shutdown` deletes the app.
RolloutClient's methods carry the docstrings; these functions take the class or the client.
"""
from __future__ import annotations

import os
import time
from typing import Optional, Union

from ..config import ClusterConfig, SecurityConfig, load_config
from ..protocol import InputError, is_number
from ..security.secrets import read_keys
from ..security.signed_router import SignedRouter
from ..security.signing import Signer


def signed_router(app_name: str, config: Optional[ClusterConfig], control_keys_file: Optional[str]) -> SignedRouter:
    from ray import serve

    # Control calls (update_weights, sleep, wake, scale, set_policy, set_trace, cancel) go out
    # signed with the first key of security.control_keys_file / $ROLLOUT_CONTROL_KEYS.
    security = config.security if config else SecurityConfig()
    if control_keys_file:
        security = security.model_copy(update={"control_keys_file": control_keys_file})
    return SignedRouter(serve.get_deployment_handle("Router", app_name), Signer(read_keys(security), app=app_name))


def start(cls, config: Union[str, ClusterConfig, dict], address: Optional[str], wait_ready_s: float,
          ray_init: dict):
    import ray
    from ray import serve

    from ..security.local import ensure_local_secrets
    from ..serve.app import build_app
    from ..serve.deploy import deploy

    cfg = load_config(config)
    if not (is_number(wait_ready_s) and wait_ready_s > 0):  # (NaN would never pass deploy's deadline)
        raise InputError("wait_ready_s", wait_ready_s, "must be a finite number of seconds > 0")
    # a cluster this driver starts gets its token and control keys made (security/local.py)
    ensure_local_secrets(cfg)
    # Only a Ray that start connects is the client's to end: never one its caller started.
    connected = not ray.is_initialized()
    if connected:
        env = {"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [_repo_root(), os.environ.get("PYTHONPATH")]))}}
        ray.init(address=address, runtime_env=env, **ray_init)
    deployed = False
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": int(os.environ.get("ROLLOUT_HTTP_PORT", 8000))})
        t0 = time.monotonic()
        deploy(build_app(cfg), cfg, wait_ready_s)  # removes the app itself if it does not come up
        deployed = True
        client = cls(cfg.app_name, config=cfg, owns_cluster=connected)
        client.wait_ready(cfg.replicas, max(1.0, wait_ready_s - (time.monotonic() - t0)))
        return client
    except BaseException:  # a failed or interrupted start leaves no app and no Ray of its own behind
        _undo_start(cfg.app_name if deployed else None, connected)
        raise


def _undo_start(app_name: Optional[str], connected: bool) -> None:
    import ray
    from ray import serve

    try:
        if app_name is not None:
            serve.delete(app_name)
    finally:
        if connected:
            ray.shutdown()


def connect(cls, app_name: str, address: str, wait_s: float, kw: dict):
    import ray

    # NaN never passes the deadline (the loop would wait forever), and a negative wait is a mistake
    if not (is_number(wait_s) and wait_s >= 0):
        raise InputError("wait_s", wait_s, "must be a finite number of seconds >= 0")

    if not ray.is_initialized():
        ray.init(address=address)
    from ray.serve.exceptions import RayServeException

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return cls(app_name, **kw)
        except (KeyError, RayServeException):  # no such app yet, or Serve itself not up yet
            if time.monotonic() >= deadline:
                raise KeyError(f"app_name={app_name!r}: no such Serve application with a Router "
                               f"after {wait_s:.0f} s (`serve status` lists the applications)") from None
            time.sleep(0.5)


def shutdown(client) -> None:
    from ray import serve

    from ..transfer import staging

    serve.delete(client.app_name)
    staging.shared().release()  # (not while a bucket is packed; a later push allocates it again)
    if client.owns_cluster:
        import ray

        ray.shutdown()


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
