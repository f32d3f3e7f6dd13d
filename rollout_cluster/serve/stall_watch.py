"""StallWatch: the router's periodic look for stalled replicas (RouterCore.check_stalls).

A replica whose engine is paused or hung (a SIGSTOPped EngineCore, a wedged GPU) keeps pulling:
its pull loop runs in another process than the engine, so `router.replica_timeout_s` never
declares it dead, and its sequences would wait for good. The core declares it stalled once it
held running sequences with no new token for `router.stall_timeout_s`: at its next report, or
here, once a second, if it pulls no more. Its sequences continue elsewhere from their last
reported tokens; its next pull is answered with Orders.stop, so its health check fails and Serve
replaces it. The stalls go to the log each on a line of its own, and to `recent` for status().
"""
from __future__ import annotations

import logging

from ..router.core import RouterCore

log = logging.getLogger("ray.serve")
RECENT_KEPT = 32  # stalls remembered for status()


class StallWatch:
    def __init__(self, core: RouterCore):
        self.core = core
        self.recent: list[tuple[float, str]] = []  # (router clock, replica id) of the latest stalls, oldest first

    def tick(self, now: float) -> list[str]:
        """Declare the replicas stalled now (their work requeued); returns their ids."""
        stalled = self.core.check_stalls(now)
        self.note(stalled, now)
        return stalled

    def note(self, replica_ids: list, now: float) -> None:
        """Record and log replicas the core declared stalled (here, or at their report)."""
        for rid in replica_ids:
            log.warning("replica %s stalled: no new token for %g s (router.stall_timeout_s) while it held "
                        "running sequences; they continue elsewhere, and it is told to stop", rid,
                        self.core.stall_timeout_s)
            self.recent.append((now, rid))
        del self.recent[:-RECENT_KEPT]

    def status(self, now: float) -> list[dict]:
        """The latest stalls, for Router.status()."""
        return [{"replica": rid, "ago_s": round(now - t, 1)} for t, rid in self.recent]
