"""`static`: the SPMD offline baseline. Each batch is split once, contiguously by group, into
equal shares, one per expected replica; a replica gets its whole share at its first pull, and
nothing moves afterwards. Work of a replica that dies is re-dispatched like `pull`; a share no
live replica holds (its replica died or left before taking it) goes to the next replica to arrive,
or after ORPHAN_SHARE_S to a replica that finished its own. The number of shares is the router's
expected fleet size, which follows replicas joining and leaving."""
from __future__ import annotations

from typing import Literal

from .base import Assign, Decision, Policy, PolicySettings
from .pull import take_for
from ..router.state import ClusterView


def split_contiguous(seqs: list, parts: int) -> list:
    """`parts` contiguous slices with sizes differing by at most one."""
    n = len(seqs)
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [seqs[bounds[i]:bounds[i + 1]] for i in range(parts)]


ORPHAN_SHARE_S = 30.0  # a share no live replica holds, queued this long, goes to one that finished its own


class StaticConfig(PolicySettings):
    name: Literal["static"] = "static"  # no settings


class StaticPolicy(Policy):
    name = "static"

    def __init__(self):
        self.share_of_replica: dict = {}  # replica_id -> share index
        self.assignment: dict = {}  # seq_id -> share index
        self.parts = 0

    def _held(self, view: ClusterView) -> set:
        """Shares held by replicas in the view (not by one that failed to load the current weights)."""
        return {i for rid, i in self.share_of_replica.items() if rid in view.replicas}

    def _claim_share(self, view: ClusterView, replica_id: str, parts: int):
        """The lowest share index no live replica holds (a replaced or removed replica's share
        goes to the next one to arrive), or None when every share has a replica."""
        held = self._held(view)
        free = next((i for i in range(parts) if i not in held), None)
        if free is not None:
            self.share_of_replica[replica_id] = free
        return free

    def decide(self, view: ClusterView, replica_id: str) -> Decision:
        parts = max(1, view.expected_replicas)
        fresh = view.queue.fresh
        unassigned = [s for s in fresh.values() if s.seq_id not in self.assignment]
        if unassigned or (fresh and parts != self.parts):
            if parts != self.parts:  # the fleet was resized: everything not started is dealt again
                self.parts, self.share_of_replica = parts, {}
                unassigned = list(fresh.values())
            self.assignment = {sid: i for sid, i in self.assignment.items() if sid in fresh}  # started: forget
            for i, share in enumerate(split_contiguous(unassigned, parts)):
                for s in share:
                    self.assignment[s.seq_id] = i
        mine = self.share_of_replica.get(replica_id)
        if mine is None:
            mine = self._claim_share(view, replica_id, self.parts or parts)
        out = [s for s in fresh.values() if self.assignment.get(s.seq_id) == mine] if mine is not None else []
        if not out and fresh:
            out = self._orphan_share(view)
        rep = view.replicas[replica_id]
        # Continuations only exist after a replica failure: re-dispatch them pull-style.
        if view.queue.continuations:
            out += take_for(view, replica_id, max(0, rep.free_slots - len(out)), homes=False)[: len(view.queue.continuations)]
            out = list({s.seq_id: s for s in out}.values())
        return Decision(assign=[Assign(s, replica_id) for s in out])

    def _orphan_share(self, view: ClusterView) -> list:
        """The queued work of a share that no live replica holds, once it has waited
        ORPHAN_SHARE_S: its replica died or left and none came in its place (the expected fleet
        size can stay above the live fleet, for one, when a replacement joined before the dead
        replica timed out). SPMD would wait for ever; this waits a while, then runs it."""
        held = self._held(view)
        for s in view.queue.fresh.values():
            i = self.assignment.get(s.seq_id)
            if i is not None and i not in held and view.now - s.submitted_t >= ORPHAN_SHARE_S:
                return [t for t in view.queue.fresh.values() if self.assignment.get(t.seq_id) == i]
        return []

    def on_replica_removed(self, replica_id: str) -> None:
        self.share_of_replica.pop(replica_id, None)
