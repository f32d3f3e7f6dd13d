"""`static`: the SPMD offline baseline. Each batch is split once, contiguously by group, into
equal shares, one per expected replica; a replica gets its whole share at its first pull, and
nothing moves afterwards. Work of a replica that dies is re-dispatched like `pull`."""
from __future__ import annotations

from .base import Assign, Decision, Policy
from .pull import take_for
from ..state import ClusterView


def split_contiguous(seqs: list, parts: int) -> list:
    """`parts` contiguous slices with sizes differing by at most one."""
    n = len(seqs)
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [seqs[bounds[i]:bounds[i + 1]] for i in range(parts)]


class StaticPolicy(Policy):
    name = "static"

    def __init__(self):
        self.share_of_replica: dict = {}  # replica_id -> share index
        self.assignment: dict = {}  # seq_id -> share index
        self.next_share = 0

    def decide(self, view: ClusterView, replica_id: str) -> Decision:
        parts = max(1, view.expected_replicas)
        unassigned = [s for s in view.queue.fresh.values() if s.seq_id not in self.assignment]
        if unassigned:
            for i, share in enumerate(split_contiguous(unassigned, parts)):
                for s in share:
                    self.assignment[s.seq_id] = i
        if replica_id not in self.share_of_replica:
            self.share_of_replica[replica_id] = self.next_share % parts
            self.next_share += 1
        mine = self.share_of_replica[replica_id]
        out = [s for s in view.queue.fresh.values() if self.assignment.get(s.seq_id) == mine]
        rep = view.replicas[replica_id]
        # Continuations only exist after a replica failure: re-dispatch them pull-style.
        if view.queue.continuations:
            out += take_for(view, replica_id, max(0, rep.free_slots - len(out)))[: len(view.queue.continuations)]
            out = list({s.seq_id: s for s in out}.values())
        return Decision(assign=[Assign(s, replica_id) for s in out])
