"""RouterCore: the single owner of sequence state. No Ray, no asyncio, no clock.

The Ray Serve Router deployment wraps it in asyncio; the simulator drives it in virtual time.
Entry points: `submit` (driver), `on_report` (a replica's pull: apply its report, decide, and
return its orders), `fetch` (finished completions of a batch), `expire` (declare silent
replicas dead). Migration semantics: docs/semantics.md.
"""
from __future__ import annotations

import itertools
import re
from array import array
from dataclasses import dataclass, field, replace
from typing import Optional

from .policy.base import Decision, Policy
from .router_adoption import OrphanAdoption
from .resume import resumed_state
from .router_control import EngineControl
from .validation import check_request
from .state import ClusterView, GroupState, ReplicaState, SeqState, SeqStatus, WorkQueue
from .protocol import (BatchLostError, Completion, InputError, Migration, ModelInfo, Orders, Report, SamplingSpec,
                    SequenceRequest, Work)


# A long-lived router serves batch after batch: its statistics keep a bounded recent window.
STEP_SAMPLES_KEPT = 100_000
DECISION_TIMES_KEPT = 100_000
FINISHED_LENGTHS_KEPT = 4096
DEPARTED_KEPT = 4096  # replicas remembered as gone after their goodbye
DROPPED_KEPT = 1024  # abandoned batches remembered, to tell a late fetch why its batch is gone
BATCH_ID = re.compile(r"^(.+-)b\d+$")  # "<the router's id prefix>b<n>": which router made a batch
CANCELLED_UNFETCHED_S = 60.0  # a cancelled batch (driver timed out) not fetched for this long is dropped


def _without_first(p, skip: int):
    """Progress report `p` without its first `skip` tokens (the router has them already)."""
    return replace(p, token_ids=p.token_ids[skip:], num_tokens=p.num_tokens - skip, offset=p.offset + skip,
                   logprobs=None if p.logprobs is None else p.logprobs[skip:], prompt_token_ids=None)


def _append_bounded(values: list, value, keep: int) -> None:
    values.append(value)
    if len(values) > 2 * keep:  # trim in bulk: amortised O(1) per append
        del values[:-keep]


class NoLiveReplicaError(RuntimeError):
    pass


class RouterMetrics:
    """Hooks the router calls; the Prometheus implementation lives in metrics.py."""

    def decision(self, seconds: float) -> None: ...
    def migration(self, source: str, reprefill_tokens: int) -> None: ...
    def give_up_latency(self, seconds: float) -> None: ...
    def finished(self, replica_id: str, reason: str) -> None: ...
    def resumed(self, source: str, reason: str) -> None: ...  # a replica left or was lost, or the router restarted
    def gauges(self, core: "RouterCore") -> None: ...
    def batches_abandoned(self, n: int) -> None: ...


@dataclass
class BatchState:
    batch_id: str
    size: int
    submitted_t: float
    results: list  # Completion or None, by index
    order: list = field(default_factory=list)  # indices in finishing order
    weights_version: int = 0
    fetched_t: float = 0.0  # the latest fetch (or the submission): drop_abandoned's clock
    cancelled: bool = False  # cancel() was called: the driver may fetch the aborts, or be gone


class RouterCore(EngineControl, OrphanAdoption):
    def __init__(self, policy: Policy, expected_replicas: int = 1, replica_timeout_s: float = 60.0,
                 metrics: Optional[RouterMetrics] = None, record_tokens: bool = True, trace: bool = False,
                 id_prefix: str = ""):
        self.policy = policy
        # Batch ids are "<id_prefix>b<n>". The Serve router passes its own id: after a restart,
        # replicas may still run the old router's sequences, whose ids must not match new ones.
        self.id_prefix = id_prefix
        self.expected_replicas = expected_replicas
        self.surplus_joins = 0  # joins that raised expected_replicas since the last death or leave
        self.unfilled_leaves = 0  # leaves no join has refilled yet (Serve replaced, or scaled down then up)
        self.last_fleet_change_t: Optional[float] = None  # the latest join or death (expire's clock)
        self.requeues = 0  # sequences put back in the queue so far (the Serve router wakes held pulls)
        self.departed: dict = {}  # (replica_id, incarnation) of replicas that said goodbye (bounded, in order)
        self.dropped: dict = {}  # batch_id -> why it was dropped unfetched (bounded, in order)
        self.replica_timeout_s = replica_timeout_s
        self.metrics = metrics or RouterMetrics()
        self.record_tokens = record_tokens
        self.queue = WorkQueue()
        self.replicas: dict = {}
        self.seqs: dict = {}
        self.groups: dict = {}
        self.batches: dict = {}
        self.outbox: dict = {}  # replica_id -> Orders
        self.give_up_t: dict = {}  # seq_id -> (time ordered, destination)
        self.model: Optional[ModelInfo] = None
        self.finished_lengths: list = []
        # reprefill_tokens: migrated context sent to a destination. reprefilled_tokens: what the
        # engines reported actually prefilling for continuations (prefix-cache hits out), over
        # reprefill_segments_measured continuation segments that reported it (vLLM only).
        self.counters = {"migrations": 0, "reprefill_tokens": 0, "reprefilled_tokens": 0,
                         "reprefill_segments_measured": 0, "generated_tokens": 0,
                         "stale_reports": 0, "policy_errors": 0, "replica_deaths": 0, "replica_leaves": 0, "lost_orders": 0,
                         "duplicate_reports": 0, "finals_whole_trimmed": 0, "handed_back": 0, "recovered": 0,
                         "orphans_given_up": 0, "orphan_outputs_kept": 0, "whole_finals_asked": 0, "adopted": 0, "adopted_tokens": 0,
                         "partials_resumed": 0, "partial_tokens_resumed": 0}
        self.decision_times: list = []
        self.finished_count = 0
        self.trace: Optional[list] = [] if trace else None  # (time, replica_id, sequences held) per pull
        # While tracing: (running, context tokens, s per token per sequence) per report, for fitting a
        # cost profile to the engines as they run here (calibrate --from-samples).
        self.step_samples: list = []
        self._ids = itertools.count()
        self._init_control()  # weights and sleep (router_control.py)
        self._init_adoption()  # a restarted router takes over its predecessor's output (router_adoption.py)

    # ---- driver side --------------------------------------------------------------------
    def submit(self, requests: list, now: float, batch_id: Optional[str] = None,
               weights_version: Optional[int] = None, previous_ids: Optional[list] = None) -> str:
        """Queue a batch of SequenceRequests. Invalid ones finish at once with an error. With
        `weights_version`, the batch is refused unless the fleet's weights are that version.
        `previous_ids` (one per request, or None): the ids the sequences had under a router that
        restarted; what that router's segments generated is taken over (router_adoption.py)."""
        if not self.replicas:
            raise NoLiveReplicaError("no live engine replica: the batch cannot run (is the cluster up?)")
        self.check_batch_weights(weights_version)
        self._refuse_while_asleep()
        self._refuse_while_learning_a_load()
        if self.no_replica_can_load():
            raise NoLiveReplicaError(f"no replica holds weights version {self.weights_version} "
                                     f"({self.weights_path!r}): {'; '.join(sorted(self.weights_errors.values()))}")
        bad = next((i for i, r in enumerate(requests) if not isinstance(r, SequenceRequest)), None)
        if bad is not None:  # refused whole, before anything is registered
            raise InputError(f"requests[{bad}]", requests[bad], "must be a SequenceRequest")
        if previous_ids is not None and (not isinstance(previous_ids, list) or len(previous_ids) != len(requests)):
            raise InputError("previous_ids", previous_ids, f"must be a list of {len(requests)} ids (or None)")
        bid = batch_id or f"{self.id_prefix}b{next(self._ids)}"
        self.weights_learning = False  # this batch runs on the version known now, and awake
        self.sleep.settle()
        batch = BatchState(bid, len(requests), now, [None] * len(requests), weights_version=self.weights_version,
                           fetched_t=now)
        self.batches[bid] = batch
        group_sizes: dict = {}
        for r in requests:
            group_sizes[(bid, r.prompt_index)] = group_sizes.get((bid, r.prompt_index), 0) + 1
        for key, size in group_sizes.items():
            self.groups[key] = GroupState(size=size)
        for i, req in enumerate(requests):
            seq = SeqState(f"{bid}:{i}", bid, i, (bid, req.prompt_index), req, now)
            error = self._validate(req)
            if error:
                seq.error = error
                self._finish(seq, "error", now, replica_id=None)
                continue
            if req.output_token_ids:  # a partial rollout resumed: a continuation from the start
                seq.generated, seq.token_ids, seq.logprobs = resumed_state(req, self.record_tokens)
                seq.resumed = seq.generated
                self.counters["partials_resumed"] += 1
                self.counters["partial_tokens_resumed"] += seq.generated
                self.metrics.resumed("-", "partial")
            self.seqs[seq.seq_id] = seq
            self.queue.push(seq)
        if previous_ids is not None:
            self._claim_orphans([self.seqs.get(f"{bid}:{i}") for i in range(len(requests))], previous_ids, now)
        return bid

    def _validate(self, req: SequenceRequest) -> Optional[str]:
        try:
            check_request(req, self.model)
        except InputError as e:
            return str(e)
        except Exception as e:  # a value no check foresaw: this sequence fails, the batch runs
            return f"invalid request: {type(e).__name__}: {e}"
        return None

    def fetch(self, batch_id: str, cursor: int, now: Optional[float] = None) -> tuple:
        """(completions finished since `cursor`, new cursor, batch done)."""
        batch = self.batches.get(batch_id)
        if batch is None:
            if batch_id in self.dropped:
                raise KeyError(f"batch_id={batch_id!r}: {self.dropped[batch_id]}")
            made_by = BATCH_ID.match(batch_id) if isinstance(batch_id, str) else None
            if self.id_prefix and made_by and made_by.group(1) != self.id_prefix:
                raise BatchLostError(f"batch_id={batch_id!r}: made by another router, not this one "
                                     f"({self.id_prefix}...): the router restarted, and its batches were lost with it")
            raise KeyError(f"batch_id={batch_id!r}: unknown batch (finished and collected, or never submitted)")
        if now is not None:
            batch.fetched_t = now
        new = [batch.results[i].with_lists() for i in batch.order[cursor:]]
        return new, len(batch.order), len(batch.order) == batch.size

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
                self._finish(seq, "abort", now, None)
            elif seq.status is SeqStatus.RUNNING:
                self._order_give_up(seq)
        return len(seqs)

    def drop_abandoned(self, now: float, idle_s: float) -> list:
        """Cancel and forget every batch nobody fetched from for `idle_s` seconds: its driver died
        (a trainer that crashed mid-step). Its running sequences are given up, its queued ones never
        start, and its tokens leave the router's memory. A batch already cancelled (its driver timed
        out and raised) goes after CANCELLED_UNFETCHED_S if that is shorter. Returns the dropped ids."""
        if idle_s <= 0:
            return []
        cancelled_s = min(idle_s, CANCELLED_UNFETCHED_S)
        gone = [bid for bid, b in self.batches.items() if now - b.fetched_t > (cancelled_s if b.cancelled else idle_s)]
        for bid in gone:
            batch = self.batches[bid]
            finished, unfetched, cancelled = len(batch.order), now - batch.fetched_t, batch.cancelled
            self.cancel(bid, now)
            self.release(bid)
            limit = (f"cancelled, and {CANCELLED_UNFETCHED_S:.0f} s is the wait for a cancelled batch" if cancelled
                     else "router.abandoned_batch_s")
            self.dropped[bid] = (f"dropped {now - batch.submitted_t:.0f} s after submission: no fetch for "
                                 f"{unfetched:.0f} s ({limit}); {finished} of {batch.size} sequences had finished")
            self.metrics.batches_abandoned(1)
            while len(self.dropped) > DROPPED_KEPT:
                del self.dropped[next(iter(self.dropped))]
        return gone

    def batches_status(self, now: float) -> dict:
        """batch_id -> size, finished, seconds since submission and since the latest fetch."""
        return {bid: {"size": b.size, "finished": len(b.order), "age_s": round(now - b.submitted_t, 1),
                      "unfetched_s": round(now - b.fetched_t, 1)} for bid, b in self.batches.items()}

    def _fail_queued(self, why: str, now: float) -> None:
        """Queued work that no replica can run ends with an error (running work cannot exist)."""
        for seq in [s for s in self.seqs.values() if s.status is SeqStatus.QUEUED]:
            self.queue.remove(seq)
            seq.error = why
            self._finish(seq, "error", now, None)

    def release(self, batch_id: str) -> None:
        batch = self.batches.pop(batch_id, None)
        if batch is None:
            return
        for key in [k for k in self.groups if k[0] == batch_id]:
            del self.groups[key]

    # ---- replica side -------------------------------------------------------------------
    def on_report(self, report: Report, now: float, timer=None) -> Orders:
        known = self.replicas.get(report.replica_id)
        if report.leaving and (known is None or known.incarnation != report.incarnation):
            return Orders()  # already declared dead: its work was requeued then
        if (report.replica_id, report.incarnation) in self.departed:
            return Orders()  # a late pull of a replica that said goodbye: not a new replica
        rep = self._register(report, now)
        if not report.number or report.number > rep.last_report_number:
            # A pull the router processes late (the replica gave up on it and pulled again) carries
            # an older state than the one applied: its sleep and weights fields are not news.
            rep.last_report_number = report.number
            self._sleep_report(rep, report)  # first: a load order waits for an engine that sleeps
            self._weights_report(rep, report, now)
        st = report.stats
        if self.trace is not None and st.seq_tokens_per_s > 0 and st.running > 0:
            _append_bounded(self.step_samples, (st.running, st.context_tokens, 1.0 / st.seq_tokens_per_s),
                            STEP_SAMPLES_KEPT)
        for p in report.progress:
            self._apply(rep, p, now, report.leaving)
        if report.leaving:
            self.remove_replica(rep.replica_id, now, leaving=not report.engine_dead, goodbye=True)
            return Orders()
        if report.listing is not None:
            self._reconcile(rep, report.listing.held, report.listing.aborting, now)
        orders = self.decide(rep.replica_id, now, timer)
        if self.trace is not None:
            self.trace.append((now, rep.replica_id, len(rep.seqs)))
        return orders

    def decide(self, replica_id: str, now: float, timer=None) -> Orders:
        rep = self.replicas.get(replica_id)
        if rep is None:
            return Orders()
        # A replica without the current weights gets no work (its load order is in its outbox), nor
        # one that sleeps or is on its way to or from sleep.
        if (len(self.queue) or self.seqs) and self.usable(rep):
            t0 = timer() if timer else None
            decision = self.policy.decide(self.view(now), replica_id)
            if timer:
                dt = timer() - t0
                _append_bounded(self.decision_times, dt, DECISION_TIMES_KEPT)
                self.metrics.decision(dt)
            self._apply_decision(decision, now)
        orders = self.outbox.pop(replica_id, None) or Orders()
        orders.work_waiting = len(self.queue) > 0
        for work in orders.start:
            seq = self.seqs.get(work.seq_id)
            if seq is not None:
                seq.delivered_pull = rep.pulls
        for seq_id, _ in orders.give_up:
            seq = self.seqs.get(seq_id)
            if seq is not None:
                seq.give_up_pull = rep.pulls
        return orders

    def _reconcile(self, rep: ReplicaState, held: list, aborting: list, now: float) -> None:
        """Work sent in the reply to an earlier pull that the replica does not hold never arrived
        (the reply was lost: the replica applies a reply's orders before it pulls again). It runs
        again from its last reported tokens, like the work of a dead replica. A give-up sent in such
        a reply is sent again: the replica holds the attempt and does not list it as aborting."""
        have = {(sid, attempt) for sid, attempt in held}
        lost = [s for s in rep.seqs.values()
                if 0 <= s.delivered_pull < rep.pulls and (s.seq_id, s.attempt) not in have]
        for seq in lost:
            del rep.seqs[seq.seq_id]
            self.counters["lost_orders"] += 1
            self.give_up_t.pop(seq.seq_id, None)  # it never ran there: not a migration
            self._requeue_after_segment(seq, rep.replica_id, now)
        aborting = {(sid, attempt) for sid, attempt in aborting}
        # Attempts the replica runs that the router does not know: a restarted router's predecessor
        # sent them (or this replica was declared dead and its work requeued). Their tokens would be
        # ignored; give them up to free the slots. Only when two listings in a row show them: a
        # final report can be drained while its attempt is still listed.
        known = {(s.seq_id, s.attempt) for s in rep.seqs.values()}
        self._note_orphans(rep, frozenset(sid for sid, attempt in have if (sid, attempt) not in known))
        unknown = frozenset(k for k in have if k not in known and k not in aborting)
        orphans = sorted(unknown & rep.unknown_held)
        rep.unknown_held = unknown.difference(orphans)
        if orphans:
            self.counters["orphans_given_up"] += len(orphans)
            orders = self.outbox.setdefault(rep.replica_id, Orders())
            orders.give_up.extend(orphans)
            orders.report_whole.extend(orphans)  # the driver may submit them again: continue them then
        for seq in rep.seqs.values():
            key = (seq.seq_id, seq.attempt)
            if (seq.status is SeqStatus.GIVING_UP and 0 <= seq.give_up_pull < rep.pulls
                    and key in have and key not in aborting):
                self.counters["lost_orders"] += 1
                seq.give_up_pull = -1
                self.outbox.setdefault(rep.replica_id, Orders()).give_up.append((seq.seq_id, seq.attempt))

    def view(self, now: float) -> ClusterView:
        """What the policy sees; a replica without the current weights, or not awake, is not part of it."""
        replicas = self.replicas
        if not all(self.usable(r) for r in replicas.values()):
            replicas = {rid: r for rid, r in replicas.items() if self.usable(r)}
        # Replicas that failed loading the weights never become usable: not expected (chunked's
        # first round, static's shares).
        failed = sum(rid in self.replicas for rid in self.weights_errors)
        return ClusterView(now, self.queue, replicas, self.groups, self.seqs, max(1, self.expected_replicas - failed),
                           self.finished_lengths, self.counters["generated_tokens"], self.counters["reprefill_tokens"])

    def expire(self, now: float) -> list:
        dead = [rid for rid, r in self.replicas.items() if now - r.last_pull_t > self.replica_timeout_s]
        for rid in dead:
            self.remove_replica(rid, now)
        if self.last_fleet_change_t is None:
            self.last_fleet_change_t = now
        live = len(self.replicas)
        if 0 < live < self.expected_replicas and now - self.last_fleet_change_t > self.replica_timeout_s:
            # Fewer replicas than expected, and none joined or died for a replica timeout: the fleet
            # is smaller than the count (a router restarted after an in-place scale-down, replicas
            # that cannot be scheduled). Waiting for the rest would stall chunked's first round,
            # static's missing shares and update_weights; a replica that joins later raises it again.
            self.expected_replicas, self.surplus_joins, self.unfilled_leaves = live, 0, 0
        if now - self.last_fleet_change_t > self.replica_timeout_s:
            # The last replica holding the weights died and none came back in a replica timeout:
            # if every one left failed loading them, nothing can run the queued work.
            self._fail_queued_if_no_replica_can_load(now)
        self._expire_orphans(now)
        return dead

    def set_fleet_target(self, replicas: int, now: float) -> None:
        """A driver told Serve to run `replicas` (RolloutClient.scale): that is the count from now
        on, before the replicas join or leave, and the corrections inferred so far are void. The
        leaves and joins that follow then change nothing (a leave lowers the count only below
        the live fleet, a join raises it only above); replicas that never come are dropped from
        it after a replica timeout, as at startup (`expire`)."""
        self.expected_replicas = max(1, int(replicas))
        self.surplus_joins = self.unfilled_leaves = 0
        self.last_fleet_change_t = now

    def remove_replica(self, replica_id: str, now: float, leaving: bool = False, goodbye: bool = False) -> None:
        """Requeue the replica's sequences from their last reported tokens. `leaving`: Serve stopped
        it on purpose (a graceful shutdown) rather than it died. `goodbye`: it said so itself (a
        graceful shutdown, or its engine died), and a late pull of it is not a new replica."""
        rep = self.replicas.pop(replica_id, None)
        if rep is None:
            return
        self._note_orphans(rep, frozenset())  # what it ran of a predecessor's runs nowhere now
        self.counters["replica_leaves" if leaving else "replica_deaths"] += 1
        if leaving or goodbye:
            self.departed[(replica_id, rep.incarnation)] = None
            while len(self.departed) > DEPARTED_KEPT:
                self.departed.pop(next(iter(self.departed)))
        if leaving:
            # Serve stopped it on purpose (scale-down, update): expect one fewer. (Not when the
            # count is already at or under the fleet left: a driver's target said so first.)
            if len(self.replicas) < self.expected_replicas:
                self.expected_replicas = max(1, self.expected_replicas - 1)
                if self.surplus_joins:  # its replacement came first (a rolling update): that join is taken back
                    self.surplus_joins -= 1
                else:
                    self.unfilled_leaves += 1
        elif goodbye:  # its engine died and it said so: Serve replaces it, and its replacement comes later
            self.last_fleet_change_t = now
        else:
            self.last_fleet_change_t = now  # give its replacement a replica timeout to join
            if self.surplus_joins > 0:
                # A dead replica is replaced, so its death alone changes nothing; but if its
                # replacement already joined (and raised the count), the count is one too high now.
                self.surplus_joins -= 1
                self.expected_replicas = max(1, self.expected_replicas - 1)
        self.outbox.pop(replica_id, None)
        self.weights_errors.pop(replica_id, None)
        self.sleep.forget(replica_id)
        for seq in list(rep.seqs.values()):
            self.give_up_t.pop(seq.seq_id, None)  # whatever was ordered, its partials never came
            self._requeue_after_segment(seq, replica_id, now, "replica_lost")  # (a cancelled one finishes)
        self.queue.release_reserved(replica_id)
        self.policy.on_replica_removed(replica_id)
        if leaving:  # for good: if every replica left failed loading the weights, none can run its work
            self._fail_queued_if_no_replica_can_load(now)

    # ---- internals ----------------------------------------------------------------------
    def _register(self, report: Report, now: float) -> ReplicaState:
        rep = self.replicas.get(report.replica_id)
        if rep is not None and rep.incarnation != report.incarnation:
            self.remove_replica(report.replica_id, now)  # restarted: its old work is gone
            rep = None
        if rep is None:
            rep = ReplicaState(report.replica_id, report.incarnation, report.capacity, now, now)
            self.replicas[report.replica_id] = rep
            self.last_fleet_change_t = now
            # More replicas than expected: the deployment was scaled up, or a replacement came
            # before its dead predecessor timed out (the next death takes that back).
            if len(self.replicas) > self.expected_replicas:
                self.expected_replicas = len(self.replicas)
                if self.unfilled_leaves:  # it takes a leaver's place: no replica's early replacement
                    self.unfilled_leaves -= 1
                else:
                    self.surplus_joins += 1
        if report.model is not None and self.model is None:
            self.model = report.model
        rep.capacity = report.capacity or rep.capacity
        rep.stats = report.stats
        rep.last_pull_t = now
        rep.pulls += 1
        return rep

    def _apply(self, rep: ReplicaState, p, now: float, leaving: bool = False) -> None:
        seq = self.seqs.get(p.seq_id)
        if seq is None and self._orphan_final(rep, p, now, leaving):
            return
        if (seq is None or seq.replica != rep.replica_id or seq.attempt != p.attempt
                or seq.status not in (SeqStatus.RUNNING, SeqStatus.GIVING_UP)):
            self.counters["stale_reports"] += 1
            return
        have = seq.generated - seq.segment_start
        if 0 <= p.offset < have:  # sent again after a lost reply, or a final sent whole
            if p.finish_reason is None or p.offset + p.num_tokens < have:
                self.counters["duplicate_reports"] += 1
                return
            p = _without_first(p, have - p.offset)  # a whole final: the tokens it adds, and the end
            self.counters["finals_whole_trimmed"] += 1
        if p.cached_tokens >= 0 and seq.segment_start > 0:  # a continuation's first report
            context = seq.request.prompt_len + seq.segment_start
            self.counters["reprefilled_tokens"] += max(0, context - p.cached_tokens)
            self.counters["reprefill_segments_measured"] += 1
        if p.num_tokens:
            seq.generated += p.num_tokens
            rep.seqs.progressed(seq)
            self.counters["generated_tokens"] += p.num_tokens
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
            seq.error = p.error or "engine error"
            self._finish(seq, "error", now, rep.replica_id)
        elif reason == "abort" or self._segment_cut(seq, reason):
            # An abort nobody ordered is a replica handing its work back before it stops.
            self._requeue_after_segment(seq, rep.replica_id, now, "replica_left" if reason == "abort" else None)
        else:
            self._finish(seq, reason, now, rep.replica_id)

    def _segment_cut(self, seq: SeqState, reason: str) -> bool:
        """A policy's segment cap (not the sequence's own end) stopped this segment."""
        if reason != "length" or seq.segment_cap is None:
            return False
        hidden = seq.request.hidden_length
        return (seq.generated - seq.segment_start >= seq.segment_cap and seq.generated < seq.max_tokens
                and (hidden is None or seq.generated < hidden))

    def _requeue_after_segment(self, seq: SeqState, source: str, now: float, cause: Optional[str] = None) -> None:
        """Queue the rest of `seq` after its segment on `source` ended short of the sequence's end:
        a policy's give-up (a migration), a chunk cut, or `cause` (a replica leaving or lost)."""
        if seq.cancelled:
            self._finish(seq, "abort", now, source)
            return
        ordered = self.give_up_t.pop(seq.seq_id, None)
        if seq.give_up_pull < 0:  # the order never reached the replica: it did not cause this end
            ordered = None
        destination = None
        if ordered is None and cause is not None:
            seq.migrations.append(Migration(source, None, seq.generated, now - seq.submitted_t, cause))
            self.counters["handed_back" if cause == "replica_left" else "recovered"] += 1
            self.metrics.resumed(source, cause)
        if ordered is not None:
            t_ordered, destination = ordered
            seq.moves += 1
            seq.last_move_t = now
            seq.migrations.append(Migration(source, destination, seq.generated, now - seq.submitted_t))
            self.counters["migrations"] += 1
            self.counters["reprefill_tokens"] += seq.context_tokens
            self.metrics.migration(source, seq.context_tokens)
            self.metrics.give_up_latency(now - t_ordered)
        seq.status, seq.replica = SeqStatus.QUEUED, None
        if destination is not None and destination not in self.replicas:
            destination = None
        self.queue.push(seq, reserved_for=destination)
        self.requeues += 1

    def _finish(self, seq: SeqState, reason: str, now: float, replica_id: Optional[str]) -> None:
        seq.status = SeqStatus.DONE
        seq.finish_reason = reason
        seq.replica = None
        self.give_up_t.pop(seq.seq_id, None)
        batch = self.batches.get(seq.batch_id)
        req = seq.request
        wants_logprobs = isinstance(req.sampling, SamplingSpec) and req.sampling.logprobs is not None
        # (an invalid request may have no spec; one that asked but ended before its first token gets [])
        logprobs = (array("d") if seq.logprobs is None else seq.logprobs) if wants_logprobs else None
        done = Completion(req.prompt_index, req.sample_index, seq.token_ids, logprobs, reason, seq.error,
                          seq.replicas, list(seq.migrations), seq.batch_id, seq.index,
                          now - seq.submitted_t, batch.weights_version if batch else self.weights_version,
                          seq.resumed)
        self.seqs.pop(seq.seq_id, None)
        if reason != "error":
            _append_bounded(self.finished_lengths, seq.generated, FINISHED_LENGTHS_KEPT)
            g = self.groups.get(seq.group)
            if g is not None:
                g.finished += 1
                g.finished_len_max = max(g.finished_len_max, seq.generated)
                g.finished_len_sum += seq.generated
        elif self.groups.get(seq.group) is not None:
            self.groups[seq.group].finished += 1
        self.metrics.finished(replica_id or "-", reason)
        self.finished_count += 1
        if batch is not None:
            batch.results[seq.index] = done
            batch.order.append(seq.index)

    def _apply_decision(self, decision: Decision, now: float) -> None:
        for a in decision.assign:
            seq = a.seq
            rep = self.replicas.get(a.replica_id)
            if seq.status is not SeqStatus.QUEUED or rep is None or rep.weights_version != self.weights_version:
                self.counters["policy_errors"] += 1
                continue
            self.queue.remove(seq)
            self._dispatch(seq, a.replica_id, a.segment_cap)
        for g in decision.give_up:
            seq = g.seq
            if seq.status is not SeqStatus.RUNNING or seq.replica not in self.replicas:
                self.counters["policy_errors"] += 1
                continue
            self.give_up_t[seq.seq_id] = (now, g.destination)
            self._order_give_up(seq)

    def _order_give_up(self, seq: SeqState) -> None:
        """Tell a running sequence's replica to give it up; its partials come back in a report."""
        seq.status = SeqStatus.GIVING_UP
        self.replicas[seq.replica].seqs.giving_up(seq)  # a RUNNING sequence's replica is live
        self.outbox.setdefault(seq.replica, Orders()).give_up.append((seq.seq_id, seq.attempt))

    def _dispatch(self, seq: SeqState, replica_id: str, segment_cap: Optional[int]) -> None:
        req = seq.request
        seq.attempt += 1
        seq.status, seq.replica = SeqStatus.RUNNING, replica_id
        seq.segment_cap, seq.segment_start = segment_cap, seq.generated
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
                    prior_logprobs=prior)
        self.replicas[replica_id].seqs[seq.seq_id] = seq
        self.outbox.setdefault(replica_id, Orders()).start.append(work)
