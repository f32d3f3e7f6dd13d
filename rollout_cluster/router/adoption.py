"""A restarted router takes over what its predecessor's segments generated.

The router keeps a batch in memory, so a router that restarts loses its batches, and the driver
submits the sequences it has not received again (client/follower.py). The replicas, though, still
run the old router's segments. The new router gives them up as orphans (RouterCore's reconcile)
and asks for their whole output in the final report (Orders.report_whole), not a delta. It keeps
that output for ORPHAN_KEEP_S, by the old sequence id. A resubmitted sequence names its old id
(`previous_ids`), and takes the output over: it continues from it as after a migration
(prompt + partial), or finishes at once if the segment had ended. Its Completion records the
take-over as a Migration with reason "router_restart". Taken only when it is exact: every token's weights
version is known and the segment ended on the batch's version, its prompt starts with the
request's, and the logprobs asked for are all there. The versions come back with the whole final:
the old router's Work carried the sequence's marks up to the segment's start
(Work.weight_versions), the engine adds where a keep swap changed them under it (swaps), and the
replica's version at the final must be the last of them (else its weights changed unmarked). The
taken-over tokens keep those labels, not the batch's version. A final without the marks is taken
only for a segment that had no earlier one (labelled with its replica's version, no swap under it).
Otherwise the sequence is generated again from its prompt, as before.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Optional, Protocol

from ..protocol import Migration, SeqProgress, is_int
from .counters import RouterCounters, RouterMetrics
from .fleet import Fleet
from .outbox import Outbox
from .state import ReplicaState, SeqState, SeqStatus

ORPHAN_KEEP_S = 600.0  # how long an orphan's output waits for its driver to submit the sequence again
ORPHANS_KEPT = 1 << 16  # and how many of them, at most (the oldest go first)
# A resubmitted sequence whose old segment may still run (a replica lists it, or some replica has
# not listed what it runs yet) waits at most this long for its output before it starts from its
# prompt: replicas list what they run every 2 s, and an orphan is given up at its second listing.
# It waits out of the queue (QUEUED, and in `awaiting_orphans`).
ADOPT_WAIT_S = 10.0


@dataclass
class OrphanOutput:
    """An old router's segment, ended on a replica: the whole output it produced (compact arrays,
    as the router keeps a live sequence's tokens)."""

    replica_id: str
    weights_version: int
    attempt: int
    prompt_token_ids: array  # the segment's prompt: the sequence's, then its earlier segments' tokens
    token_ids: array
    logprobs: Optional[array]
    finish_reason: str
    t: float
    prior_logprobs: Optional[array] = None  # of the prompt's generated tail (a continuation's earlier segments)
    swapped: bool = False  # weights were swapped under it (running="keep"): it did not run on one version
    # Its Work's weight_versions, then its swaps (offsets counted from the segment's start) as
    # (offset, version) pairs; None: the final did not carry its Work's marks (or bad ones)
    versions: Optional[list] = None
    swaps: list = field(default_factory=list)
    weights_path: str = ""  # the source of the replica's `weights_version` at the final ("": not said)

    @classmethod
    def of(cls, rep: ReplicaState, p: SeqProgress, now: float) -> "OrphanOutput":
        swaps = int_pairs(p.swaps or [])  # (bad ones: the versions are not known)
        versions = int_pairs(p.weight_versions) if p.weight_versions and swaps is not None else None
        return cls(rep.replica_id, rep.weights_version, p.attempt, array("i", p.prompt_token_ids),
                   array("i", p.token_ids), None if p.logprobs is None else array("d", p.logprobs),
                   p.finish_reason, now, None if p.prior_logprobs is None else array("d", p.prior_logprobs),
                   bool(p.swaps), versions, swaps or [], rep.weights_path)

    def labels(self, resumed: int, earlier: int) -> Optional[list]:
        """The taken-over tokens' weight_versions (from `resumed` on; the segment started after
        `earlier` tokens), or None if they are not all known: no marks (and an earlier segment, or
        a swap), or weights that changed under the segment unmarked (the replica's version at the
        final is not the last mark)."""
        if self.versions is None:
            if earlier > resumed or self.swapped:
                return None
            return [(resumed, self.weights_version)]
        marks = self.versions + [(earlier + o, v) for o, v in self.swaps]
        if marks[-1][1] != self.weights_version or marks[0][0] > resumed:
            return None
        if any(b[0] < a[0] for a, b in zip(marks, marks[1:])):
            return None
        total = earlier + len(self.token_ids)
        out: list = []
        for offset, version in marks:
            offset = max(offset, resumed)
            if offset >= total and out:  # a change at or past the last token labels none of them
                break
            while out and out[-1][0] >= offset:  # a later change at the same token replaces it
                out.pop()
            if not out or out[-1][1] != version:
                out.append((offset, version))
        return out


def int_pairs(pairs) -> Optional[list]:
    """A replica's (offset, version) pairs as tuples; None unless every one is two integers,
    the offset not negative."""
    if not isinstance(pairs, (list, tuple)):
        return None
    out = []
    for pair in pairs:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and is_int(pair[0]) and is_int(pair[1])
                and pair[0] >= 0):
            return None
        out.append((pair[0], pair[1]))
    return out


class AdoptionHost(Protocol):
    """What adoption needs of the router's sequences: SeqMoves (moves.py) provides it."""

    def seq(self, seq_id: str) -> Optional[SeqState]: ...  # a live sequence
    def batch_version(self, batch_id: str) -> Optional[int]: ...  # its batch's weights version (None: gone)
    def same_weights(self, version: int, path: str) -> bool: ...  # not other weights under the router's number
    def requeue(self, seq: SeqState) -> None: ...  # into the queue (a continuation if it has tokens)
    def unqueue(self, seq: SeqState) -> None: ...  # out of the queue: it waits for its output
    def finish(self, seq: SeqState, reason: str, now: float, replica_id: Optional[str]) -> None: ...


class OrphanAdoption:
    """The old router's outputs, kept until their sequences come back, and those waiting for them."""

    def __init__(self, host: AdoptionHost, fleet: Fleet, outbox: Outbox, counters: RouterCounters,
                 metrics: RouterMetrics, record_tokens: bool, id_prefix: str):
        self.host, self.fleet, self.outbox = host, fleet, outbox
        self.counters, self.metrics = counters, metrics
        self.record_tokens = record_tokens  # the simulator keeps no tokens: nothing to take over
        self.id_prefix = id_prefix  # this router's sequences' ids start with it; a predecessor's do not
        self.orphan_outputs: dict[str, OrphanOutput] = {}  # old seq_id -> its output, in arrival order
        self.awaiting_orphans: dict[str, tuple[str, float]] = {}  # old seq_id -> (new seq_id, since): resubmitted before it ended
        self.orphan_listings: dict[str, int] = {}  # old seq_id -> how many replicas listed it running, at their last listing
        # old seq_id -> when its final came as a delta and its whole output was asked for again
        self.whole_asked: dict[str, float] = {}

    def note_listing(self, rep: ReplicaState, ids: frozenset) -> None:
        """A replica's listing: `ids` are the sequences it runs that this router does not know."""
        rep.listed = True
        for sid in rep.orphan_ids - ids:
            left = self.orphan_listings.get(sid, 0) - 1
            if left > 0:
                self.orphan_listings[sid] = left
            else:
                self.orphan_listings.pop(sid, None)
                if sid in self.awaiting_orphans and not self._may_still_run(sid):
                    self._stop_waiting(sid)  # it ended without a whole output: from the prompt
        for sid in ids - rep.orphan_ids:
            self.orphan_listings[sid] = self.orphan_listings.get(sid, 0) + 1
        rep.orphan_ids = ids
        if self.awaiting_orphans and self._every_replica_listed():
            # now known not to run anywhere: from the prompt, without waiting
            for old in [o for o in self.awaiting_orphans if not self._may_still_run(o)]:
                self._stop_waiting(old)

    def _every_replica_listed(self) -> bool:
        return len(self.fleet.replicas) >= self.fleet.expected and all(r.listed for r in self.fleet.replicas.values())

    def _may_still_run(self, old: str) -> bool:
        """Its whole output may still come: a replica runs it, one has not listed what it runs,
        or one was asked to send its ended final again, whole."""
        return old in self.orphan_listings or old in self.whole_asked or not self._every_replica_listed()

    def _stop_waiting(self, old: str) -> None:
        sid, _ = self.awaiting_orphans.pop(old)
        seq = self.host.seq(sid)
        if seq is not None and seq.status is SeqStatus.QUEUED:
            self.host.requeue(seq)

    def take_final(self, rep: ReplicaState, p: SeqProgress, now: float, leaving: bool = False) -> bool:
        """An unknown attempt's final report. If it is a whole output, keep it for the sequence's
        resubmission, or hand it to that sequence at once. Returns whether it was taken."""
        if p.finish_reason is None:
            return False
        if self.id_prefix and p.seq_id.startswith(self.id_prefix):
            return False  # this router's own, finished already (a final sent whole after a lost reply)
        failed = p.finish_reason == "error" and p.retryable is not True  # (a retryable one continues, as an abort)
        if p.offset != 0 or p.prompt_token_ids is None or failed:
            if not failed and self.id_prefix and not leaving:
                # A delta: the replica did not know this router took over when it sent it (its pull
                # went through the restart). Ask for it again whole: the engine keeps it a while.
                # (Not of a replica saying goodbye: it goes, with what it kept.)
                if p.seq_id not in self.whole_asked:
                    self.whole_asked[p.seq_id] = now
                    self.outbox.to(rep.replica_id).report_whole.append((p.seq_id, p.attempt))
                    self.counters.whole_finals_asked += 1
            elif p.seq_id in self.awaiting_orphans:
                self._stop_waiting(p.seq_id)  # ended, and its output went with the old router
            return False
        self.whole_asked.pop(p.seq_id, None)
        out = OrphanOutput.of(rep, p, now)
        waiting = self.awaiting_orphans.pop(p.seq_id, None)
        if waiting is not None:
            seq = self.host.seq(waiting[0])
            if seq is not None:
                adopted = self._adopt(seq, out, now)
                if seq.status is SeqStatus.QUEUED:
                    self.host.requeue(seq)  # it runs now, continued or from its prompt
                if adopted:
                    return True
        kept = self.orphan_outputs.get(p.seq_id)
        if kept is None or kept.attempt < out.attempt:  # the old router's latest attempt of it
            self.orphan_outputs[p.seq_id] = out
            self.counters.orphan_outputs_kept += 1
        while len(self.orphan_outputs) > ORPHANS_KEPT:
            self.orphan_outputs.pop(next(iter(self.orphan_outputs)))
        return True

    def claim(self, seqs: list, previous_ids: list, now: float) -> None:
        """Resubmitted sequences (None: refused as invalid), each with the id it had under the router
        that restarted (or None)."""
        for seq, old in zip(seqs, previous_ids):
            if old is None or seq is None or seq.status is not SeqStatus.QUEUED:
                continue
            out = self.orphan_outputs.pop(old, None)
            if out is None:
                # (one sequence waits for an old id at a time: another batch naming it again runs from its prompt)
                if old not in self.awaiting_orphans and self._may_still_run(old):  # wait for its output a little
                    self.awaiting_orphans[old] = (seq.seq_id, now)
                    self.host.unqueue(seq)
            elif not self._adopt(seq, out, now):
                self.orphan_outputs[old] = out  # not this one's (another prompt): it may still be claimed

    def _adopt(self, seq: SeqState, out: OrphanOutput, now: float) -> bool:
        """Give `seq`, queued and never run, the orphan's output, if it is exactly this sequence's
        (a resumed partial rollout's output included: the segment's prompt then starts with it)."""
        if (seq.status is not SeqStatus.QUEUED or seq.attempt or seq.generated != seq.resumed
                or not self.record_tokens):
            return False
        req = seq.request
        version = self.host.batch_version(seq.batch_id)
        if version is None or out.weights_version != version or req.prompt_token_ids is None:
            return False
        if not self.host.same_weights(out.weights_version, out.weights_path):
            return False  # a cut-off replica's number, which this router gave other weights since
        prompt = req.prompt_token_ids
        if out.prompt_token_ids[:len(prompt)].tolist() != prompt:
            return False
        earlier = out.prompt_token_ids[len(prompt):]  # a continuation's earlier segments
        labels = out.labels(seq.resumed, len(earlier))
        if labels is None:
            return False
        tokens = earlier + out.token_ids
        if tokens[:seq.resumed] != seq.token_ids:
            return False
        wants_logprobs = req.sampling.logprobs is not None
        if wants_logprobs and (out.logprobs is None or len(out.logprobs) != len(out.token_ids) or earlier and (
                out.prior_logprobs is None or len(out.prior_logprobs) != len(earlier))):
            return False
        if len(tokens) > req.sampling.max_tokens:
            return False
        seq.token_ids = tokens
        seq.logprobs = ((out.prior_logprobs + out.logprobs) if earlier else out.logprobs) if wants_logprobs else None
        seq.generated = len(tokens)
        seq.weight_versions = labels  # the versions that made what it took over
        seq.replicas.append(out.replica_id)
        seq.migrations.append(Migration(out.replica_id, None, seq.generated, now - seq.submitted_t, "router_restart"))
        self.counters.adopted += 1
        self.counters.adopted_tokens += len(tokens)
        self.metrics.resumed(out.replica_id, "router_restart")
        # "length" may be the old router's cut (a chunk, a hidden length's stop): the end only at a cap
        if out.finish_reason == "stop" or seq.at_cap:
            self.host.unqueue(seq)
            self.host.finish(seq, "stop" if out.finish_reason == "stop" else "length", now, out.replica_id)
        else:
            self.host.requeue(seq)  # a continuation now: the continuations' lane
        return True

    def expire(self, now: float) -> None:
        for old in [k for k, o in self.orphan_outputs.items() if now - o.t > ORPHAN_KEEP_S]:
            del self.orphan_outputs[old]
        for old in [k for k, t in self.whole_asked.items() if now - t >= ADOPT_WAIT_S]:
            del self.whole_asked[old]  # it never came whole (an engine that keeps no outputs)
            if old in self.awaiting_orphans and not self._may_still_run(old):
                self._stop_waiting(old)
        for old, (sid, t) in list(self.awaiting_orphans.items()):
            if self.host.seq(sid) is None or now - t >= ADOPT_WAIT_S:
                self._stop_waiting(old)  # no output came: from its prompt
