"""How many engine replicas a (re)started Router expects: the live EngineReplica deployment's
target, as Serve holds it, not the config's count.

RolloutClient.scale sets the target in place (Serve's external scaling API), so after a scale a
Router that Serve restarts would otherwise expect the config's `replicas`: fewer than run (it
would number a weights order before it heard them all, weights_floor.py, and static's shares
would leave replicas out) or more (update_weights waits a replica timeout for ones that never
come). The target is read once, when the Router starts, from the Serve controller; outside a
Serve replica (tests, the simulator) or if the controller does not answer in time, the config's
count stands. Fleet then follows later scales (set_target) and what it sees, as before.
"""
from __future__ import annotations

import logging
from typing import Optional

log = logging.getLogger("ray.serve")

REPLICA_DEPLOYMENT = "EngineReplica"  # the engines' Serve deployment (serve/app.py's class name)
ASK_TIMEOUT_S = 5.0  # the most a starting Router waits for the controller's answer


def target_in(details: dict, app_name: str, deployment: str = REPLICA_DEPLOYMENT) -> Optional[int]:
    """The deployment's target_num_replicas in Serve's instance details (the controller's
    get_serve_instance_details: a ServeInstanceDetails as a dict); None if it is not there or not
    a count >= 1."""
    try:
        n = details["applications"][app_name]["deployments"][deployment]["target_num_replicas"]
    except (KeyError, TypeError):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


def serve_target() -> Optional[int]:
    """The live target of this application's EngineReplica deployment, asked of the Serve
    controller; None outside a Serve replica (nothing is asked: no Ray is started)."""
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        app_name = serve.get_replica_context().app_name
    except RayServeException:
        return None
    import ray
    from ray.serve.context import _get_global_client

    controller = _get_global_client()._controller
    details = ray.get(controller.get_serve_instance_details.remote(), timeout=ASK_TIMEOUT_S)
    return target_in(details, app_name)


def expected_replicas(configured: int) -> int:
    """What a starting Router expects: Serve's live target, else the config's `configured`."""
    try:
        target = serve_target()
    except Exception as e:  # the controller did not answer: the config's count, as before
        log.warning("router: Serve's target for %s is unknown (%s: %s); expecting the config's %d replicas",
                    REPLICA_DEPLOYMENT, type(e).__name__, e, configured)
        return configured
    if target is not None and target != configured:
        log.info("router: expecting %d replicas, Serve's live target (the config says %d: scaled since)",
                 target, configured)
    return configured if target is None else target
