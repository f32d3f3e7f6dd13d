"""Membership: replicas joining the fleet, and leaving it with their work put back in the queue.

A replica joins by pulling (`register`). It leaves by saying goodbye (Serve stopped it, or its
engine died), by pulling under a new incarnation (it restarted), by going silent for the replica
timeout (`expire`), or by stalling: pulling on while its running sequences make no progress for
`stall_timeout_s` (`check_stalls`, and at each of its reports). Whatever the way, `remove` is
the one exit: every sequence it held continues from its last reported tokens (no sequence is
lost), the continuations reserved for it go back to every replica, and every component forgets
it. Fleet counts who comes and goes; this carries out what a departure means for the work.

No clock (time is an argument), no I/O.
"""
from __future__ import annotations

from typing import Optional

from ..protocol import ModelInfo, Report
from .adoption import OrphanAdoption
from .control import FleetControl
from .counters import RouterCounters, RouterMetrics
from .digests import FleetDigests
from .dispatch import Dispatcher
from .fleet import Fleet
from .moves import SeqMoves
from .outbox import Outbox
from .sleep import FleetSleep
from .state import ReplicaState, WorkQueue
from .weights import FleetWeights


class Membership:
    def __init__(self, fleet: Fleet, stall_timeout_s: float, queue: WorkQueue, outbox: Outbox, moves: SeqMoves,
                 dispatcher: Dispatcher, adoption: OrphanAdoption, weights: FleetWeights, sleep: FleetSleep,
                 digests: FleetDigests, counters: RouterCounters, metrics: RouterMetrics, control: FleetControl):
        self.fleet, self.queue, self.outbox, self.moves, self.dispatcher = fleet, queue, outbox, moves, dispatcher
        self.control = control  # a streamed push none of the replicas left can load is aborted
        self.adoption, self.weights, self.sleep, self.digests = adoption, weights, sleep, digests
        self.counters, self.metrics = counters, metrics
        # A replica holding running sequences with no new token for this long is stalled (0: never).
        self.stall_timeout_s = stall_timeout_s
        self.model: Optional[ModelInfo] = None  # the first replica's; requests are checked against it

    def register(self, report: Report, now: float) -> ReplicaState:
        """The replica that sent `report`, joined if new; a restarted one's old work is requeued first."""
        if self.fleet.restarted(report):
            old = self.fleet.replicas[report.replica_id].incarnation
            self.remove(report.replica_id, now)  # restarted: its old work is gone
            self.fleet.superseded(report.replica_id, old)  # a late pull of the old incarnation is not a restart back
        rep = self.fleet.join(report, now)
        if report.model is not None and self.model is None:
            self.model = report.model
        return rep

    def stalls(self, rep: ReplicaState, now: float) -> bool:
        """`rep` is stalled at `now` (and stall detection is on)."""
        return self.stall_timeout_s > 0 and rep.stalled(now, self.stall_timeout_s)

    def expire(self, now: float) -> list:
        """Declare replicas that stopped pulling dead (their work requeued); returns their ids."""
        dead = self.fleet.silent(now)
        for rid in dead:
            self.remove(rid, now)
        if self.fleet.settle(now):
            # The last replica holding the weights died and none came back in a replica timeout:
            # if every one left failed loading them, nothing can run the queued work.
            self.moves.fail_queued_if_no_replica_can_load(now)
        return dead

    def check_stalls(self, now: float) -> list:
        """Declare stalled the replicas that hold running sequences and reported no new token for
        stall_timeout_s; returns their ids."""
        if self.stall_timeout_s <= 0:
            return []
        stalled = self.fleet.stalled(now, self.stall_timeout_s)
        for rid in stalled:
            self.remove(rid, now, stalled=True)
        return stalled

    def remove(self, replica_id: str, now: float, leaving: bool = False, goodbye: bool = False,
               stalled: bool = False) -> None:
        """Requeue the replica's sequences from their last reported tokens. `leaving`: Serve stopped
        it on purpose (a graceful shutdown) rather than it died. `goodbye`: it said so itself (a
        graceful shutdown, or its engine died), and a late pull of it is not a new replica.
        `stalled`: the router declared it stalled; a late pull of it is told to stop."""
        rep = self.fleet.pop(replica_id)
        if rep is None:
            return
        self.adoption.note_listing(rep, frozenset())  # what it ran of a predecessor's runs nowhere now
        self.fleet.removed(rep, now, leaving, goodbye, stalled)
        if leaving:
            self.counters.replica_leaves += 1
        elif stalled:
            self.counters.replica_stalls += 1
            self.metrics.replica_stalled(replica_id)
        else:
            self.counters.replica_deaths += 1
        self.outbox.drop(replica_id)
        if not (leaving or stalled):  # died: during a load, that load may be what killed it
            self.weights.died_loading(rep)
        self.weights.forget(replica_id)
        self.sleep.forget(replica_id)
        self.digests.forget(replica_id)
        for seq in list(rep.seqs.values()):
            self.moves.give_up_t.pop(seq.seq_id, None)  # whatever was ordered, its partials never came
            self.moves.requeue_after_segment(seq, replica_id, now, "replica_lost")  # (a cancelled one finishes)
        self.queue.release_reserved(replica_id)
        self.dispatcher.replica_removed(replica_id)
        gone = self.control.abort_unloadable_push()  # the last replica that could still load a streamed push left
        if gone is not None:
            self.moves.after_push_abort(*gone, now)
        elif leaving:  # for good: if every replica left failed loading the weights, none can run its work
            self.moves.fail_queued_if_no_replica_can_load(now)
