"""ReportApplier: what a replica's report says, taken in.

The first step of a pull (RouterCore.apply), after the replica is registered: its engine's state
(sleep level, weights, step stats), its sequences' progress, and, every few seconds, its listing
of the attempts it holds, reconciled with what the router sent it. Progress is accepted only
from the replica that holds the sequence and only for its current attempt (state.py); tokens
sent again after a lost reply are dropped by their offset, so none is counted twice. A segment's
end finishes its sequence or requeues the rest (SeqMoves). Its own state: none; what it learns
goes to the sequences, the counters and the components that own the rest.

No clock (time is an argument), no I/O.
"""
from __future__ import annotations

import logging
from array import array
from dataclasses import replace

from ..protocol import Report, SeqProgress, is_int
from .adoption import OrphanAdoption
from .control import FleetControl
from .counters import RouterCounters
from .moves import SeqMoves
from .outbox import Outbox
from .state import ReplicaState, SeqState, SeqStatus
from .tracing import RouterTrace

log = logging.getLogger(__name__)


def _without_first(p: SeqProgress, skip: int) -> SeqProgress:
    """Progress report `p` without its first `skip` tokens (the router has them already)."""
    return replace(p, token_ids=p.token_ids[skip:], num_tokens=p.num_tokens - skip, offset=p.offset + skip,
                   logprobs=None if p.logprobs is None else p.logprobs[skip:], prompt_token_ids=None)


class ReportApplier:
    def __init__(self, seqs: dict[str, SeqState], control: FleetControl, moves: SeqMoves, adoption: OrphanAdoption,
                 outbox: Outbox, tracing: RouterTrace, counters: RouterCounters, record_tokens: bool,
                 engine_error_retries: int = 2):
        self.seqs = seqs  # the router's live sequences: a report's progress names them
        self.control, self.moves, self.adoption, self.outbox = control, moves, adoption, outbox
        self.tracing, self.counters = tracing, counters
        self.record_tokens = record_tokens  # False in the simulator: tokens are counted, not kept
        self.engine_error_retries = engine_error_retries  # retryable engine errors a sequence continues after

    def engine_state(self, rep: ReplicaState, report: Report, now: float) -> None:
        """Its sleep level and weights, unless a newer report's were applied already (a pull the
        router processed late carries an older state). Sleep first: a load waits for an engine
        that sleeps. Then the reported engine stats, sampled while tracing."""
        if not report.number or report.number > rep.last_report_number:
            rep.last_report_number = report.number
            self.control.apply_sleep(rep, report.sleep)
            if self.control.apply_weights(rep, report.weights, learn=not self.seqs):
                gone = self.control.abort_unloadable_push()  # (a streamed push none can load: the fleet goes back)
                if gone is not None:
                    self.moves.after_push_abort(*gone, now)
                else:
                    self.moves.fail_queued_if_no_replica_can_load(now)
        self.tracing.step(report.stats)

    def progress(self, rep: ReplicaState, report: Report, now: float) -> None:
        """Every sequence's progress in the report (a leaving replica's finals hand its work back)."""
        for p in report.progress:
            self.seq_progress(rep, p, now, report.leaving, report.leaving and report.engine_dead)

    def seq_progress(self, rep: ReplicaState, p: SeqProgress, now: float, leaving: bool = False,
                     engine_dead: bool = False) -> None:
        """One sequence's new tokens, and its segment's end if this is its final report (`leaving`
        with `engine_dead`: the goodbye of a replica whose engine died or broke)."""
        seq = self.seqs.get(p.seq_id)
        if seq is None and self.adoption.take_final(rep, p, now, leaving):
            return
        if (seq is None or seq.replica != rep.replica_id or seq.attempt != p.attempt
                or seq.status not in (SeqStatus.RUNNING, SeqStatus.GIVING_UP)):
            self.counters.stale_reports += 1
            return
        have = seq.generated - seq.segment_start
        if p.offset > have:
            self.report_gap(rep, seq, p, now)
            return
        if 0 <= p.offset < have:  # sent again after a lost reply, or a final sent whole
            if p.finish_reason is None or p.offset + p.num_tokens < have:
                self.counters.duplicate_reports += 1
                return
            p = _without_first(p, have - p.offset)  # a whole final: the tokens it adds, and the end
            self.counters.finals_whole_trimmed += 1
        if p.swaps:
            self.note_swaps(seq, p.swaps)
        if p.cached_tokens >= 0 and seq.segment_start > 0:  # a continuation's first report
            context = seq.request.prompt_len + seq.segment_start
            self.counters.reprefilled_tokens += max(0, context - p.cached_tokens)
            self.counters.reprefill_segments_measured += 1
        elif p.cached_tokens >= 0:  # a fresh segment's first report: how much of its prompt was cached
            self.counters.prompt_tokens_measured += seq.request.prompt_len
            self.counters.prompt_cached_tokens += min(p.cached_tokens, seq.request.prompt_len)
        if p.num_tokens:
            rep.progress_t = now  # (check_stalls)
            seq.generated += p.num_tokens
            rep.seqs.progressed(seq)
            self.counters.generated_tokens += p.num_tokens
            if self.record_tokens:
                seq.token_ids.extend(p.token_ids)
                if p.logprobs is not None:
                    if seq.logprobs is None:
                        seq.logprobs = array("d")
                    seq.logprobs.extend(p.logprobs)
        reason = p.finish_reason
        if reason is None:
            return
        del rep.seqs[seq.seq_id]
        if reason == "error":
            self.ended_in_error(rep, seq, p, now)
        elif reason == "abort" or self.segment_cut(seq, reason):
            # An abort nobody ordered is a replica handing its work back before it stops (or, its
            # engine dead or broken, before Serve replaces it: a death, not a scale-down).
            unordered = "replica_lost" if engine_dead else "replica_left"
            cause = seq.give_up_cause or (unordered if reason == "abort" else None)
            self.moves.requeue_after_segment(seq, rep.replica_id, now, cause)
        else:
            self.moves.finish(seq, reason, now, rep.replica_id)

    def report_gap(self, rep: ReplicaState, seq: SeqState, p: SeqProgress, now: float) -> None:
        """A report whose offset lies past the tokens the router holds: the tokens between never
        came (the pull protocol resends a lost report, so this should not happen; if it does, a
        completion must not silently lack them). It is not applied: the sequence continues from the
        tokens the router holds, exactly as a migration does."""
        self.counters.report_gaps += 1
        log.warning("report of %s attempt %d from %s starts at token %d, the router holds %d: continuing "
                    "from the tokens it holds", seq.seq_id, p.attempt, rep.replica_id, p.offset,
                    seq.generated - seq.segment_start)
        if p.finish_reason is None:
            if seq.status is SeqStatus.RUNNING:
                seq.give_up_cause = "report_gap"
                self.moves.order_give_up(seq)
            return
        del rep.seqs[seq.seq_id]
        if p.finish_reason == "error":
            self.ended_in_error(rep, seq, p, now)
        else:  # its end (and the tokens before it) must be made again
            self.moves.requeue_after_segment(seq, rep.replica_id, now, seq.give_up_cause or "report_gap")

    def ended_in_error(self, rep: ReplicaState, seq: SeqState, p: SeqProgress, now: float) -> None:
        """A segment the engine ended with an error. One it calls retryable (a failure inside the engine,
        not the request's) continues from the tokens the router holds, as after a replica's loss, at most
        engine_error_retries times a sequence; any other, or one past that bound, ends the sequence."""
        why = p.error or "engine error"
        if p.retryable is True and seq.at_cap:
            self.moves.finish(seq, "length", now, rep.replica_id)  # its error came with its last token: nothing to retry
            return
        if p.retryable is True and not seq.cancelled and seq.engine_errors < self.engine_error_retries:
            seq.engine_errors += 1
            self.counters.engine_error_retries += 1
            log.warning("%s ended in an error on %s (%s): continuing from its %d tokens (retry %d of %d)",
                        seq.seq_id, rep.replica_id, why, seq.generated, seq.engine_errors, self.engine_error_retries)
            self.moves.give_up_t.pop(seq.seq_id, None)  # a policy's give-up in flight did not end it: the error did
            self.moves.requeue_after_segment(seq, rep.replica_id, now, "engine_error")
            return
        if p.retryable is True and not seq.cancelled:
            why += (f" (the engines' retryable errors ended it {seq.engine_errors + 1} times; "
                    f"router.engine_error_retries={self.engine_error_retries})")
        seq.error = why
        self.moves.finish(seq, "error", now, rep.replica_id)

    def note_swaps(self, seq: SeqState, swaps: list) -> None:
        """The replica swapped weights under this attempt (running="keep"): its tokens from
        segment_start + offset on are the new version's. Every report after the swap carries it
        again, each swap of the attempt: a version already in weight_versions is not added twice
        (versions only grow: a version appears once in a sequence's history)."""
        for offset, version in swaps:
            if not (is_int(offset) and is_int(version)) or offset < 0:
                continue
            if any(v == version for _, v in seq.weight_versions):
                continue
            at = max(seq.segment_start + offset, seq.weight_versions[-1][0] if seq.weight_versions else 0)
            seq.weight_versions.append((at, version))
            self.counters.weights_kept += 1

    def segment_cut(self, seq: SeqState, reason: str) -> bool:
        """A policy's segment cap (not the sequence's own end) stopped this segment."""
        if reason != "length" or seq.segment_cap is None:
            return False
        return seq.generated - seq.segment_start >= seq.segment_cap and not seq.at_cap

    def reconcile(self, rep: ReplicaState, held: list, aborting: list, now: float, fresh: bool = True) -> None:
        """Work sent in the reply to an earlier pull that the replica does not hold never arrived
        (the reply was lost: the replica applies a reply's orders before it pulls again). It runs
        again from its last reported tokens, like the work of a dead replica. A give-up sent in such
        a reply is sent again: the replica holds the attempt and does not list it as aborting.
        Not from a listing that is not `fresh` (its report was processed after a newer one): it
        was taken before the replies sent since, whose work and give-ups it cannot show."""
        have = {(sid, attempt) for sid, attempt in held}
        lost = [s for s in rep.seqs.values()
                if fresh and 0 <= s.delivered_pull < rep.pulls and (s.seq_id, s.attempt) not in have]
        for seq in lost:
            del rep.seqs[seq.seq_id]
            self.counters.lost_orders += 1
            self.moves.give_up_t.pop(seq.seq_id, None)  # it never ran there: not a migration
            self.moves.requeue_after_segment(seq, rep.replica_id, now)
        aborting = {(sid, attempt) for sid, attempt in aborting}
        # Attempts the replica runs that the router does not know: a restarted router's predecessor
        # sent them (or this replica was declared dead and its work requeued). Their tokens would be
        # ignored; give them up to free the slots. Only when two listings in a row show them: a
        # final report can be drained while its attempt is still listed.
        known = {(s.seq_id, s.attempt) for s in rep.seqs.values()}
        self.adoption.note_listing(rep, frozenset(sid for sid, attempt in have if (sid, attempt) not in known))
        unknown = frozenset(k for k in have if k not in known and k not in aborting)
        orphans = sorted(unknown & rep.unknown_held)
        rep.unknown_held = unknown.difference(orphans)
        if orphans:
            self.counters.orphans_given_up += len(orphans)
            orders = self.outbox.to(rep.replica_id)
            orders.give_up.extend(orphans)
            orders.report_whole.extend(orphans)  # the driver may submit them again: continue them then
        for seq in rep.seqs.values():
            key = (seq.seq_id, seq.attempt)
            if (fresh and seq.status is SeqStatus.GIVING_UP and 0 <= seq.give_up_pull < rep.pulls
                    and key in have and key not in aborting):
                self.counters.lost_orders += 1
                seq.give_up_pull = -1
                self.outbox.to(rep.replica_id).give_up.append((seq.seq_id, seq.attempt))
