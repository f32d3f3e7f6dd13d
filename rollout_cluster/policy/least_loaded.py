"""`least-loaded`: online push. Every queued sequence goes at once to the replica with the
fewest sequences in flight (what Ray Serve's power-of-two router or vLLM's data-parallel
load balancer does), with no cap and no migration. Ties go round-robin, so a group spreads."""
from __future__ import annotations

import heapq
from typing import Literal

from .base import Assign, Decision, Policy, PolicySettings
from ..router.state import ClusterView


class LeastLoadedConfig(PolicySettings):
    name: Literal["least-loaded"] = "least-loaded"  # no settings


class LeastLoadedPolicy(Policy):
    name = "least-loaded"

    def decide(self, view: ClusterView, replica_id: str) -> Decision:
        if not len(view.queue):
            return Decision()
        heap = [(r.load, i, rid) for i, (rid, r) in enumerate(sorted(view.replicas.items()))]
        heapq.heapify(heap)
        out = []
        for seq in list(view.queue.unreserved()) + [s for lane in view.queue.reserved.values() for s in lane.values()]:
            load, i, rid = heapq.heappop(heap)
            out.append(Assign(seq, rid))
            heapq.heappush(heap, (load + 1, i, rid))
        return Decision(assign=out)
