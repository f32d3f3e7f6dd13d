"""The engine fleet as the router knows it: who pulls, and how many replicas there should be.

Replicas join by pulling, and leave by saying goodbye (Serve stopped them), by restarting (a new
incarnation), by going silent for `replica_timeout_s`, or by stalling: pulling on while holding
running sequences that make no progress for the router's stall timeout (`stalled`). The expected count is what static's
shares, chunked's first round and update_weights wait for. It starts at the live deployment's
target (the Serve Router reads it at its start, serve/fleet_target.py: a router restarted after a
`scale` expects the scaled fleet), else the config's count, follows a driver's `scale`
(set_target), and corrects itself from what it sees:
- a join above the count raises it (a scale-up, or a replacement that came before its dead
  predecessor timed out: `surplus_joins` remembers those, and the next death takes one back);
- a leave lowers it (a scale-down; `unfilled_leaves` until a join takes the place again);
- fewer live replicas than expected for a whole replica timeout, with no join or death in
  between, lowers it to the live count (replicas that cannot be scheduled, a router restarted
  after an in-place scale-down).

Plain bookkeeping: no clock (time is an argument), no I/O. Membership (membership.py) requeues
a removed replica's sequences; this only says who left.
"""
from __future__ import annotations

from typing import Optional

from ..protocol import Report, check_replicas
from .state import ReplicaState

DEPARTED_KEPT = 4096  # replicas remembered as gone after their goodbye


class Fleet:
    def __init__(self, expected: int, replica_timeout_s: float):
        self.replicas: dict[str, ReplicaState] = {}  # replica_id -> state, live replicas only
        self.expected = expected  # how many replicas there should be
        self.replica_timeout_s = replica_timeout_s  # no pull for this long: the replica is dead
        self.surplus_joins = 0  # joins that raised `expected` since the last death or leave
        self.unfilled_leaves = 0  # leaves no join has refilled yet (Serve replaced, or scaled down then up)
        self.last_change_t: Optional[float] = None  # the latest join or death (the shrink rule's clock)
        # (replica_id, incarnation) of replicas that said goodbye or were replaced by a new
        # incarnation, in order (bounded): a late pull of one is not a new replica
        self.departed: dict[tuple[str, str], None] = {}
        # Of those, the ones the router declared stalled (bounded, in order): a late pull of one is
        # answered with an order to stop, its reports are not applied.
        self.stalled_out: dict[tuple[str, str], None] = {}

    def __len__(self) -> int:
        return len(self.replicas)

    def gone(self, report: Report) -> bool:
        """A pull to ignore: a goodbye of a replica already declared dead (its work was requeued
        then), or any pull of one that said goodbye or was replaced by a new incarnation."""
        known = self.replicas.get(report.replica_id)
        if report.leaving and (known is None or known.incarnation != report.incarnation):
            return True
        return (report.replica_id, report.incarnation) in self.departed

    def was_stalled(self, report: Report) -> bool:
        """The report comes from a replica (this incarnation) the router declared stalled."""
        return (report.replica_id, report.incarnation) in self.stalled_out

    def restarted(self, report: Report) -> bool:
        """The replica pulls under a new incarnation: its old state (and work) is gone."""
        rep = self.replicas.get(report.replica_id)
        return rep is not None and rep.incarnation != report.incarnation

    def join(self, report: Report, now: float) -> ReplicaState:
        """The replica that sent `report`, registered if new; its pull is counted."""
        rep = self.replicas.get(report.replica_id)
        if rep is None:
            rep = ReplicaState(report.replica_id, report.incarnation, report.capacity, now, now)
            self.replicas[report.replica_id] = rep
            self.last_change_t = now
            if len(self.replicas) > self.expected:
                self.expected = len(self.replicas)
                if self.unfilled_leaves:  # it takes a leaver's place: no replica's early replacement
                    self.unfilled_leaves -= 1
                else:
                    self.surplus_joins += 1
        rep.capacity = report.capacity or rep.capacity
        rep.stats = report.stats
        rep.last_pull_t = now
        rep.pulls += 1
        return rep

    def pop(self, replica_id: str) -> Optional[ReplicaState]:
        """Take a replica out of the live fleet; returns its state (None: not live). Then `removed`."""
        return self.replicas.pop(replica_id, None)

    def superseded(self, replica_id: str, incarnation: str) -> None:
        """The replica restarted: its old incarnation's pulls, processed late, are ignored (gone)."""
        _remember(self.departed, (replica_id, incarnation))

    def removed(self, rep: ReplicaState, now: float, leaving: bool, goodbye: bool, stalled: bool = False) -> None:
        """Count a replica taken out. `leaving`: Serve stopped it on purpose. `goodbye`: it said so
        itself (a graceful stop, or its engine died). `stalled`: the router declared it stalled; it
        is told to stop and Serve replaces it, as after an engine's death with a goodbye."""
        replica_id = rep.replica_id
        goodbye = goodbye or stalled
        if stalled:
            _remember(self.stalled_out, (replica_id, rep.incarnation))
        if leaving or goodbye:
            _remember(self.departed, (replica_id, rep.incarnation))
        if leaving:
            # Serve stopped it on purpose (scale-down, update): expect one fewer. (Not when the
            # count is already at or under the fleet left: a driver's target said so first.)
            if len(self.replicas) < self.expected:
                self.expected = max(1, self.expected - 1)
                if self.surplus_joins:  # its replacement came first (a rolling update): that join is taken back
                    self.surplus_joins -= 1
                else:
                    self.unfilled_leaves += 1
        elif goodbye:  # its engine died and it said so: Serve replaces it, and its replacement comes later
            self.last_change_t = now
        else:
            self.last_change_t = now  # give its replacement a replica timeout to join
            if self.surplus_joins > 0:
                # A dead replica is replaced, so its death alone changes nothing; but if its
                # replacement already joined (and raised the count), the count is one too high now.
                self.surplus_joins -= 1
                self.expected = max(1, self.expected - 1)

    def stalled(self, now: float, timeout_s: float) -> list[str]:
        """Replicas that hold running sequences and made no progress (ReplicaState.progress_t) for
        longer than `timeout_s`: stalled (an engine paused or hung while its replica still pulls)."""
        return [rid for rid, r in self.replicas.items() if r.stalled(now, timeout_s)]

    def silent(self, now: float) -> list[str]:
        """Replicas that have not pulled for a replica timeout: dead."""
        return [rid for rid, r in self.replicas.items() if now - r.last_pull_t > self.replica_timeout_s]

    def settle(self, now: float) -> bool:
        """Apply the shrink rule. Returns whether the fleet has been still for a replica timeout
        (no join or death), which is when a fleet that cannot load the weights is given up on."""
        if self.last_change_t is None:
            self.last_change_t = now
        still = now - self.last_change_t > self.replica_timeout_s
        live = len(self.replicas)
        if 0 < live < self.expected and still:
            self.expected, self.surplus_joins, self.unfilled_leaves = live, 0, 0
        return still

    def set_target(self, replicas: int, now: float) -> None:
        """A driver told Serve to run `replicas` (RolloutClient.scale): that is the count from now
        on, before the replicas join or leave, and the corrections inferred so far are void. The
        leaves and joins that follow then change nothing (a leave lowers the count only below
        the live fleet, a join raises it only above); replicas that never come are dropped from
        it after a replica timeout, as at startup (`settle`). A count that is no integer >= 1 is
        refused, naming it (a signer other than RolloutClient's may send one)."""
        check_replicas(replicas)
        self.expected = replicas
        self.surplus_joins = self.unfilled_leaves = 0
        self.last_change_t = now


def _remember(kept: dict, key: tuple) -> None:
    """Add `key` to an ordered set bounded at DEPARTED_KEPT (the oldest go first)."""
    kept[key] = None
    while len(kept) > DEPARTED_KEPT:
        kept.pop(next(iter(kept)))
