"""BatchIntake: a driver's batches in and out: submit (refuse, check, queue), cancel, and the
drop of batches whose driver is gone.

A batch is atomic: whatever would fail all of it (no replica, other weights, the fleet asleep,
the driver's own code at fault, a limit) refuses it before anything is registered. Each request
is then checked on its own (validation.py): an invalid one finishes at once with an error naming
the field, and the rest of the batch runs. A request that passes is runnable, so nothing
registered can raise afterwards.

No clock (time is an argument), no I/O.
"""
from __future__ import annotations

from typing import Optional

from ..parsing import shown
from ..protocol import InputError, SequenceRequest
from ..validation import check_place, check_request
from .adoption import OrphanAdoption
from .batches import Batches
from .control import FleetControl
from .counters import RouterCounters, RouterMetrics
from .fleet import Fleet
from .limits import BatchLimits
from .membership import Membership
from .moves import SeqMoves
from .sessions import SessionHomes
from .sleep import FleetSleep
from .state import SeqState, SeqStatus, WorkQueue
from .weights import FleetWeights


class NoLiveReplicaError(RuntimeError):
    pass


class BatchIntake:
    def __init__(self, limits: BatchLimits, seqs: dict[str, SeqState], queue: WorkQueue, batches: Batches,
                 fleet: Fleet, membership: Membership, control: FleetControl, weights: FleetWeights,
                 sleep: FleetSleep, sessions: SessionHomes, adoption: OrphanAdoption, moves: SeqMoves,
                 counters: RouterCounters, metrics: RouterMetrics, record_tokens: bool):
        self.limits = limits  # bounds on a batch (the config's `limits`)
        self.seqs = seqs  # the router's live sequences: a batch's valid ones join them
        self.queue, self.batches, self.fleet, self.membership = queue, batches, fleet, membership
        self.control, self.weights, self.sleep = control, weights, sleep
        self.sessions, self.adoption, self.moves = sessions, adoption, moves
        self.counters, self.metrics = counters, metrics
        self.record_tokens = record_tokens  # False in the simulator: a resumed output is counted, not kept

    def submit(self, requests: list, now: float, batch_id: Optional[str] = None,
               weights_version: Optional[int] = None, previous_ids: Optional[list] = None) -> str:
        """Queue a batch of SequenceRequests. Invalid ones finish at once with an error. With
        `weights_version`, the batch is refused unless the fleet's weights are that version.
        `previous_ids` (one per request, or None): the ids the sequences had under a router that
        restarted; what that router's segments generated is taken over (adoption.py).
        Atomic: what would fail the batch is refused before anything is registered, and every
        request is checked first, so that none registered can raise afterwards (a request that
        passes check_request is runnable: its state builds without another check)."""
        self._refuse_batch(weights_version)
        self._refuse_malformed(requests, batch_id, previous_ids)
        self.limits.check_batch(len(requests), self._live(len(requests)))
        errors = [self._validate(req) for req in requests]
        self.weights.learning = False  # this batch runs on the version known now, and awake
        self.sleep.settle()
        batch = self.batches.open(len(requests), now, self.weights.version, batch_id)
        batch.pinned = weights_version is not None
        bid = batch.batch_id
        self.batches.open_groups(bid, [r.prompt_index for r in requests])
        for i, (req, error) in enumerate(zip(requests, errors)):
            seq = SeqState(f"{bid}:{i}", bid, i, (bid, req.prompt_index), req, now)
            if error:
                seq.error = error
                self.moves.finish(seq, "error", now, replica_id=None)
                continue
            if req.output_token_ids:  # a partial rollout resumed: a continuation from the start
                seq.resume(self.record_tokens)
                self.counters.partials_resumed += 1
                self.counters.partial_tokens_resumed += seq.generated
                self.metrics.resumed("-", "partial")
            seq.home = self.sessions.home(req.session, self.fleet.replicas)
            self.seqs[seq.seq_id] = seq
            self.queue.push(seq)
        if previous_ids is not None:
            self.adoption.claim([self.seqs.get(f"{bid}:{i}") for i in range(len(requests))], previous_ids, now)
        return bid

    def _refuse_batch(self, weights_version: Optional[int]) -> None:
        """Raise if no batch can run now: no replica, other weights, asleep, weights in doubt."""
        if not self.fleet.replicas:
            raise NoLiveReplicaError("no live engine replica: the batch cannot run (is the cluster up?)")
        self.control.refuse_batch(weights_version)
        if self.weights.none_can_load(self.fleet.replicas):
            raise NoLiveReplicaError(self.weights.failure())

    @staticmethod
    def _refuse_malformed(requests: list, batch_id, previous_ids) -> None:
        """What the driver's code (not its user) got wrong refuses the whole batch: a request that
        is none, or has no place in it (its group is keyed by prompt_index), ids of the wrong kind."""
        if not isinstance(requests, list):
            raise InputError("requests", requests, "must be a list of SequenceRequests")
        for i, req in enumerate(requests):
            if not isinstance(req, SequenceRequest):
                raise InputError(f"requests[{i}]", req, "must be a SequenceRequest")
            check_place(req, f"requests[{i}].")
        if batch_id is not None and (not isinstance(batch_id, str) or not batch_id):
            raise InputError("batch_id", batch_id, "must be null or a non-empty string")
        if previous_ids is not None and (not isinstance(previous_ids, list) or len(previous_ids) != len(requests)
                                         or not all(p is None or isinstance(p, str) for p in previous_ids)):
            raise InputError("previous_ids", previous_ids, f"must be a list of {len(requests)} ids (or None)")
        named = [p for p in previous_ids or () if p is not None]
        if len(set(named)) != len(named):
            twice = next(p for p in named if named.count(p) > 1)
            raise InputError("previous_ids", f"<{len(previous_ids)} ids>", f"names {twice!r} twice: each old id belongs "
                             "to one sequence")

    def _validate(self, req: SequenceRequest) -> Optional[str]:
        past_limit = self.limits.n_error(getattr(req.sampling, "n", None))
        if past_limit:
            return past_limit
        try:
            check_request(req, self.membership.model)
        except InputError as e:
            return str(e)
        except Exception as e:  # a value no check foresaw: this sequence fails, the batch runs
            return f"invalid request: {type(e).__name__}: {shown(str(e))}"
        return None

    def _live(self, size: int) -> int:
        """The live sequences a new batch of `size` counts against limits.max_live_sequences: a
        cancelled one no longer does, though its replica has not confirmed the give-up yet (counted
        only when the limit is near: a pass over every live sequence)."""
        live, cap = len(self.seqs), self.limits.max_live_sequences
        if cap is not None and live + size > cap:
            live -= sum(1 for s in self.seqs.values() if s.cancelled)
        return live

    def cancel(self, batch_id: str, now: float) -> int:
        """Stop a batch (the driver timed out or gave up): queued sequences finish as "abort"
        at once, running ones when their replica confirms the give-up. Returns how many."""
        seqs = [s for s in self.seqs.values() if s.batch_id == batch_id]
        if batch_id in self.batches:
            self.batches[batch_id].cancelled = True
        for seq in seqs:
            seq.cancelled = True
            if seq.status is SeqStatus.QUEUED:
                self.queue.remove(seq)
                self.moves.finish(seq, "abort", now, None)
            elif seq.status is SeqStatus.RUNNING:
                self.moves.order_give_up(seq)
        return len(seqs)

    def drop_abandoned(self, now: float, idle_s: float) -> list:
        """Cancel and forget every batch nobody fetched from for `idle_s` seconds: its driver died
        (a trainer that crashed mid-step). Its running sequences are given up, its queued ones never
        start, and its tokens leave the router's memory. Returns the dropped ids."""
        gone = self.batches.abandoned(now, idle_s)
        for bid in gone:
            self.batches.drop(bid, now, idle_s)  # (its reason, from the state before the cancel)
            self.cancel(bid, now)
            self.metrics.batches_abandoned(1)
        return gone
