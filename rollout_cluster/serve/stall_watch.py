"""StallWatch: the router's periodic look for stalled replicas (RouterCore.check_stalls).

A replica whose engine is paused or hung (a SIGSTOPped EngineCore, a wedged GPU) keeps pulling:
its pull loop runs in another process than the engine, so `router.replica_timeout_s` never
declares it dead, and its sequences would wait for good. The core declares it stalled once it
held running sequences with no new token for `router.stall_timeout_s`: at its next report, or
here, once a second, if it pulls no more. Its sequences continue elsewhere from their last
reported tokens; its next pull is answered with Orders.stop, so its health check fails and Serve
replaces it. Each stall goes to the log on a line of its own; status() counts them
(counters.replica_stalls), and so does Prometheus (rollout_replica_stalls_total).
"""
from __future__ import annotations

import logging

from ..router.core import RouterCore

log = logging.getLogger("ray.serve")


class StallWatch:
    def __init__(self, core: RouterCore):
        self.core = core  # the router's core: it decides, this only looks and logs

    def tick(self, now: float) -> list[str]:
        """Declare the replicas stalled now (their work requeued); returns their ids."""
        stalled = self.core.check_stalls(now)
        self.note(stalled)
        return stalled

    def note(self, replica_ids: list) -> None:
        """Log replicas the core declared stalled (here, or at their report)."""
        for rid in replica_ids:
            log.warning("replica %s stalled: no new token for %g s (router.stall_timeout_s) while it held "
                        "running sequences; they continue elsewhere, and it is told to stop", rid,
                        self.core.stall_timeout_s)
