"""Dispatcher: the policy's decision at a replica's pull, and the orders that go out with it.

At each pull the policy sees the cluster (`view`) and returns a Decision: queued sequences to
start on live replicas, running ones to give up (for a destination, or none). The decision is
checked against the state as it is now, since a policy may name a sequence no longer eligible
(counted as a policy error, never applied), and carried out by SeqMoves. The orders waiting for
the puller then leave the outbox, and each sequence remembers the pull whose reply carried its
Work or give-up: a later listing that lacks it finds the reply lost (reports.py).

Owns the policy (set_policy swaps it between batches) and the decision times. No clock: `now`
is an argument, and a driver that measures decisions passes its own `timer`.
"""
from __future__ import annotations

from typing import Callable, Optional

from ..policy.base import Decision, Policy
from ..protocol import LoadWeights, Orders
from .batches import Batches
from .control import FleetControl
from .counters import RouterCounters, RouterMetrics
from .fleet import Fleet
from .moves import SeqMoves
from .outbox import Outbox
from .state import ClusterView, SeqState, SeqStatus, WorkQueue
from .tracing import append_bounded
from .weights import FleetWeights

DECISION_TIMES_KEPT = 100_000


class Dispatcher:
    def __init__(self, policy: Policy, seqs: dict[str, SeqState], queue: WorkQueue, batches: Batches, fleet: Fleet,
                 outbox: Outbox, control: FleetControl, weights: FleetWeights, moves: SeqMoves,
                 counters: RouterCounters, metrics: RouterMetrics):
        self.policy = policy  # decides at every pull; set_policy replaces it between batches
        self.seqs, self.queue, self.batches, self.fleet, self.outbox = seqs, queue, batches, fleet, outbox
        self.control, self.weights, self.moves = control, weights, moves
        self.counters, self.metrics = counters, metrics
        self.decision_times: list[float] = []  # seconds per decision, while a driver passes a timer (recent)

    def decide(self, replica_id: str, now: float, timer: Optional[Callable[[], float]] = None) -> Orders:
        """The policy's decision at this replica's pull; returns the orders waiting for it."""
        rep = self.fleet.replicas.get(replica_id)
        if rep is None:
            return Orders()
        # A replica without the current weights gets no work (its load order is in its outbox), nor
        # one that sleeps or is on its way to or from sleep.
        usable = self.control.usable(rep)
        if not usable:  # a continuation a give-up kept for it waits for no replica that cannot take it
            self.queue.release_reserved(replica_id)
        if (len(self.queue) or self.seqs) and usable:
            t0 = timer() if timer else None
            decision = self.policy.decide(self.view(now), replica_id)
            if timer:
                dt = timer() - t0
                append_bounded(self.decision_times, dt, DECISION_TIMES_KEPT)
                self.metrics.decision(dt)
            self.apply_decision(decision, now)
        orders = self.outbox.take(replica_id)
        orders.work_waiting = len(self.queue) > 0
        for order in orders.control:
            if isinstance(order, LoadWeights):  # (a death before this reply is no death in that load)
                rep.weights_order_sent = order.version
        # (each stamp only for the attempt the order names: one of an earlier attempt says nothing of the current)
        for work in orders.start:
            seq = self.seqs.get(work.seq_id)
            if seq is not None and seq.attempt == work.attempt:
                seq.delivered_pull = rep.pulls
        for seq_id, attempt in orders.give_up:
            seq = self.seqs.get(seq_id)
            if seq is not None and seq.attempt == attempt:
                seq.give_up_pull = rep.pulls
        return orders

    def view(self, now: float) -> ClusterView:
        """What the policy sees; a replica without the current weights, or not awake, is not part of it."""
        replicas = self.fleet.replicas
        usable = self.control.usable
        if not all(usable(r) for r in replicas.values()):
            replicas = {rid: r for rid, r in replicas.items() if usable(r)}
        # Replicas that failed loading the weights, or waking, never become usable until an order
        # mends them: not expected (chunked's first round, static's shares).
        failed = sum(rid in self.fleet.replicas for rid in set(self.weights.errors) | set(self.control.sleep.errors))
        return ClusterView(now, self.queue, replicas, self.batches.groups, self.seqs,
                           max(1, self.fleet.expected - failed), self.moves.finished_lengths,
                           self.counters.generated_tokens, self.counters.reprefill_tokens)

    def apply_decision(self, decision: Decision, now: float) -> None:
        """Carry out what is still eligible of `decision`; the rest counts as policy errors."""
        for a in decision.assign:
            seq = a.seq
            rep = self.fleet.replicas.get(a.replica_id)
            if seq.status is not SeqStatus.QUEUED or rep is None or not self.weights.holds(rep):
                self.counters.policy_errors += 1
                continue
            self.queue.remove(seq)
            if not rep.seqs:  # its first running sequence: its progress is measured from now
                rep.progress_t = now
            self.moves.dispatch(seq, a.replica_id, a.segment_cap)
        for g in decision.give_up:
            seq = g.seq
            if seq.status is not SeqStatus.RUNNING or seq.replica not in self.fleet.replicas:
                self.counters.policy_errors += 1
                continue
            self.moves.give_up_t[seq.seq_id] = (now, g.destination)
            self.moves.order_give_up(seq)

    def replica_removed(self, replica_id: str) -> None:
        """The replica left the fleet: the policy forgets what it kept about it."""
        self.policy.on_replica_removed(replica_id)
