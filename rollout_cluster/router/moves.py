"""SeqMoves: a sequence's moves between the queue, a replica and done.

Every change of a sequence's place goes through here: dispatch (queued -> running on a replica),
a give-up order (running -> giving up), a requeue after a segment that ended short of the
sequence's end (a migration, a chunk cut, a replica lost or leaving), and the finish (-> done,
its Completion recorded in its batch). Others decide when; this keeps state.py's invariants (a
sequence in one place, one attempt per dispatch) and counts what each move cost.

It is also what adoption asks of the router's sequences (adoption.AdoptionHost). Plain state:
no clock (time is an argument), no I/O (Work and give-ups go into the outbox).
"""
from __future__ import annotations

from array import array
from dataclasses import replace
from typing import Optional

from ..protocol import Completion, Migration, SamplingSpec, Work
from .batches import Batches
from .counters import RouterCounters, RouterMetrics
from .fleet import Fleet
from .outbox import Outbox
from .sessions import SessionHomes
from .state import SeqState, SeqStatus, WorkQueue
from .tracing import append_bounded
from .weights import FleetWeights

FINISHED_LENGTHS_KEPT = 4096


class SeqMoves:
    def __init__(self, seqs: dict[str, SeqState], queue: WorkQueue, batches: Batches, fleet: Fleet, outbox: Outbox,
                 weights: FleetWeights, sessions: SessionHomes, counters: RouterCounters, metrics: RouterMetrics):
        self.seqs = seqs  # the router's: seq_id -> state of every unfinished sequence (a finish removes it)
        self.queue, self.batches, self.fleet, self.outbox = queue, batches, fleet, outbox
        self.weights, self.sessions = weights, sessions
        self.counters, self.metrics = counters, metrics
        # seq_id -> (when, destination) of a policy's give-up: a migration if its order reached the replica
        self.give_up_t: dict[str, tuple[float, Optional[str]]] = {}
        self.finished_lengths: list[int] = []  # recent finished sequences' lengths (the policy's evidence)
        self.finished_count = 0  # sequences finished, ever
        self.requeues = 0  # sequences put back in the queue, ever

    def dispatch(self, seq: SeqState, replica_id: str, segment_cap: Optional[int]) -> None:
        """Start a new attempt of queued `seq` on `replica_id`: its Work waits in the outbox."""
        req = seq.request
        seq.attempt += 1
        seq.status, seq.replica = SeqStatus.RUNNING, replica_id
        seq.segment_cap, seq.segment_start = segment_cap, seq.generated
        seq.give_up_cause = None
        held = self.fleet.replicas[replica_id].weights_version
        wv = seq.weight_versions
        # A change at or past the tokens kept labels none of them (a keep swap's mark past the tokens
        # its replica delivered, which are made again here; a segment that made none): this
        # segment's version starts where its tokens do.
        while wv and wv[-1][0] >= seq.generated:
            wv.pop()
        if not wv or wv[-1][1] != held:
            wv.append((seq.generated, held))
        # A new attempt: neither its Work nor a give-up has gone out yet (a pull number left from an
        # earlier attempt would have the next listing take this Work, still in the outbox, for lost).
        seq.give_up_pull = seq.delivered_pull = -1
        if not seq.replicas or seq.replicas[-1] != replica_id:
            seq.replicas.append(replica_id)
        last = seq.migrations[-1] if seq.migrations else None
        if last is not None and last.destination != replica_id and last.at_token == seq.generated:
            # the continuation starts here, not where the move meant it to (gone, or never reached)
            seq.migrations[-1] = replace(last, destination=replica_id)
        stop_after = segment_cap
        if req.hidden_length is not None:
            left = max(1, req.hidden_length - seq.generated)
            stop_after = left if stop_after is None else min(stop_after, left)
        prompt = None if req.prompt_token_ids is None else req.prompt_token_ids + seq.token_ids.tolist()
        # A continuation's earlier logprobs, for a take-over after a router restart; not for a
        # chunked round's segment (every round of every sequence: their size grows as the square
        # of the length), which a restarted router therefore generates again when logprobs are asked.
        prior = (array("d", seq.logprobs) if seq.generated and seq.logprobs is not None and prompt is not None
                 and segment_cap is None else None)
        work = Work(seq.seq_id, seq.attempt, prompt, req.sampling.for_continuation(seq.generated), stop_after,
                    prompt_len=req.prompt_len + seq.generated, prefix_key=seq.group, prefix_len=req.prompt_len,
                    prior_logprobs=prior, weight_versions=None if prompt is None else list(wv))
        self.fleet.replicas[replica_id].seqs[seq.seq_id] = seq
        self.outbox.to(replica_id).start.append(work)

    def take_back_unsent(self) -> None:
        """An in-flight weights update (running=keep/recompute/abort): Work still in an outbox never
        ran, and goes back to the queue, as queued work runs on the new weights. (Sent, it would go
        with its replica's load: the replica starts it once the load is done, and waits for that
        without pulling, its running sequences unreported, past the replica timeout for a long
        load; with a give-up behind it, it ran on the new weights until the give-up landed.)"""
        for rid in self.outbox.replica_ids():
            orders = self.outbox[rid]
            for work in list(orders.start):
                seq = self.seqs.get(work.seq_id)
                if (seq is not None and seq.status is SeqStatus.RUNNING and seq.replica == rid
                        and seq.attempt == work.attempt):
                    orders.start.remove(work)
                    del self.fleet.replicas[rid].seqs[seq.seq_id]
                    seq.status, seq.replica = SeqStatus.QUEUED, None
                    self.queue.push(seq)

    def order_give_up(self, seq: SeqState) -> None:
        """Tell a running sequence's replica to give it up; its partials come back in a report."""
        seq.status = SeqStatus.GIVING_UP
        self.fleet.replicas[seq.replica].seqs.giving_up(seq)  # a RUNNING sequence's replica is live
        self.outbox.to(seq.replica).give_up.append((seq.seq_id, seq.attempt))

    def give_up_running(self, abort: bool) -> None:
        """An in-flight weights update: every running sequence is given up, to continue on the new
        weights (its end's cause: weights_update), or, with `abort`, to end as "abort" with its tokens
        (after take_back_unsent: only what runs on a replica)."""
        for seq in self.seqs.values():
            if seq.status is SeqStatus.RUNNING:
                if abort:
                    seq.cancelled = True  # its final "abort" ends it, tokens and all
                else:
                    seq.give_up_cause = "weights_update"
                self.order_give_up(seq)
            elif seq.status is SeqStatus.GIVING_UP and abort:
                seq.cancelled = True

    def requeue_after_segment(self, seq: SeqState, source: str, now: float, cause: Optional[str] = None) -> None:
        """Queue the rest of `seq` after its segment on `source` ended short of the sequence's end:
        a policy's give-up (a migration), a chunk cut, or `cause` (a replica leaving or lost)."""
        if seq.cancelled:
            self.finish(seq, "abort", now, source)
            return
        ordered = self.give_up_t.pop(seq.seq_id, None)
        if seq.give_up_pull < 0:  # the order never reached the replica: it did not cause this end
            ordered = None
        destination = None
        if ordered is None and cause is not None:
            seq.migrations.append(Migration(source, None, seq.generated, now - seq.submitted_t, cause))
            if cause == "weights_update":
                self.counters.weights_recomputed += 1
            elif cause == "replica_left":
                self.counters.handed_back += 1
            else:
                self.counters.recovered += 1
            self.metrics.resumed(source, cause)
        if ordered is not None:
            t_ordered, destination = ordered
            seq.moves += 1
            seq.last_move_t = now
            seq.migrations.append(Migration(source, destination, seq.generated, now - seq.submitted_t))
            self.counters.migrations += 1
            self.counters.reprefill_tokens += seq.context_tokens
            self.metrics.migration(source, seq.context_tokens)
            self.metrics.give_up_latency(now - t_ordered)
        seq.status, seq.replica = SeqStatus.QUEUED, None
        if destination is not None and destination not in self.fleet.replicas:
            destination = None
        self.queue.push(seq, reserved_for=destination)
        self.requeues += 1

    def finish(self, seq: SeqState, reason: str, now: float, replica_id: Optional[str]) -> None:
        """`seq` ends with `reason` (on `replica_id`; None: it ran nowhere at its end): its
        Completion goes to its batch, and it leaves the router's live sequences."""
        seq.status = SeqStatus.DONE
        seq.finish_reason = reason
        seq.replica = None
        self.give_up_t.pop(seq.seq_id, None)
        batch = self.batches.get(seq.batch_id)
        req = seq.request
        wants_logprobs = isinstance(req.sampling, SamplingSpec) and req.sampling.logprobs is not None
        # (an invalid request may have no spec; one that asked but ended before its first token gets [])
        logprobs = (array("d") if seq.logprobs is None else seq.logprobs) if wants_logprobs else None
        wv = seq.weight_versions
        while len(wv) > 1 and wv[-1][0] >= seq.generated:  # a keep swap's mark past the tokens kept labels none
            wv.pop()
        version = (seq.weight_versions[-1][1] if seq.weight_versions
                   else batch.weights_version if batch else self.weights.version)
        done = Completion(req.prompt_index, req.sample_index, seq.token_ids, logprobs, reason, seq.error,
                          seq.replicas, list(seq.migrations), seq.batch_id, seq.index,
                          now - seq.submitted_t, version, seq.resumed, list(seq.weight_versions))
        self.seqs.pop(seq.seq_id, None)
        # A length is evidence for the policies only where the sequence ended by itself: one cut off
        # ("abort": cancelled, a batch cut at its finish fraction) is shorter than it would have been
        natural = reason in ("stop", "length")
        if natural:
            append_bounded(self.finished_lengths, seq.generated, FINISHED_LENGTHS_KEPT)
        if reason != "error":
            self.sessions.record(req.session, replica_id)  # its context is cached there now
        self.batches.group_finished(seq.group, seq.generated, counts_length=natural)
        self.metrics.finished(replica_id or "-", reason)
        self.finished_count += 1
        self.batches.record(seq.batch_id, seq.index, done)

    def fail_queued_if_no_replica_can_load(self, now: float) -> None:
        if self.weights.none_can_load(self.fleet.replicas):
            self.fail_queued(self.weights.failure(), now)

    def after_push_abort(self, aborted: int, source: str, reason: str, now: float) -> None:
        """The streamed push `source` was aborted as version `aborted` (by its trainer, or by the
        router once no replica could load it): the batches opened on it, none of whose sequences ran
        (no replica could hold it), run on the version gone back to; those whose driver named the
        aborted version fail (WeightsVersionError's words), as a batch naming a version the fleet is
        not at is refused."""
        named = set()
        for bid, batch in self.batches.live.items():
            if batch.weights_version == aborted and batch.pinned:
                named.add(bid)
            elif batch.weights_version == aborted:
                batch.weights_version = self.weights.version
        if named:
            self.fail_queued(f"weights_version={aborted}: the push of that version ({source}) was aborted "
                             f"({reason}); the fleet's weights are version {self.weights.version} again: the batch "
                             "was not run", now, batches=named)

    def fail_queued(self, why: str, now: float, batches: Optional[set] = None) -> None:
        """Queued work that no replica can run ends with an error (running work cannot exist);
        `batches`: only theirs."""
        for seq in [s for s in self.seqs.values() if s.status is SeqStatus.QUEUED
                    and (batches is None or s.batch_id in batches)]:
            self.queue.remove(seq)
            seq.error = why
            self.finish(seq, "error", now, None)

    # ---- what adoption asks of the router's sequences (adoption.AdoptionHost; `finish` above) -----
    def seq(self, seq_id: str) -> Optional[SeqState]:
        return self.seqs.get(seq_id)

    def batch_version(self, batch_id: str) -> Optional[int]:
        batch = self.batches.get(batch_id)
        return None if batch is None else batch.weights_version

    def same_weights(self, version: int, path: str) -> bool:
        """`version` from `path` is not other weights than this router's `version` (a source is
        known only for the current version: another number is taken by its number)."""
        return version != self.weights.version or self.weights.current(version, path)

    def requeue(self, seq: SeqState) -> None:
        self.queue.push(seq)

    def unqueue(self, seq: SeqState) -> None:
        self.queue.remove(seq)
