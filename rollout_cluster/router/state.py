"""The router's state, as plain objects the policy reads (never mutates).

Invariants (the router keeps them; tests check them):
- a sequence is in exactly one place: a queue, one replica's `seqs`, or done;
- `attempt` grows by one at every dispatch; a report is accepted only from the replica that
  holds the sequence and only for its current attempt, so a late report of an old attempt
  (an abort racing a natural finish, a replica thought dead) is dropped;
- `generated` counts every token the router has accepted for the sequence, across segments.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict
from itertools import islice
from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from ..protocol import EngineStats, SequenceRequest
from .seq_table import SeqTable


class SeqStatus(Enum):
    QUEUED = "queued"
    RUNNING = "running"
    GIVING_UP = "giving_up"  # give-up ordered; waiting for the source's final report
    DONE = "done"


@dataclass(eq=False)
class SeqState:
    seq_id: str
    batch_id: str
    index: int  # position in the batch
    group: tuple  # (batch_id, prompt_index): samples of one prompt
    request: SequenceRequest
    submitted_t: float
    status: SeqStatus = SeqStatus.QUEUED
    attempt: int = 0
    replica: Optional[str] = None
    generated: int = 0
    # Compact arrays (4 and 8 bytes a token, against about 36 and 32 for Python ints and floats in
    # a list): the router holds every token of a batch until the batch is fetched.
    token_ids: array = field(default_factory=lambda: array("i"))
    logprobs: Optional[array] = None  # array("d") once the first logprob arrives
    segment_cap: Optional[int] = None  # tokens this segment may produce before the policy's cut
    segment_start: int = 0  # `generated` when the current segment started
    resumed: int = 0  # tokens it started with: a partial rollout's output from an earlier batch (`resume`)
    replicas: list = field(default_factory=list)  # every replica that ran a segment
    migrations: list = field(default_factory=list)
    moves: int = 0
    last_move_t: float = float("-inf")
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    cancelled: bool = False  # the driver gave up on the batch: finish as "abort", never requeue
    home: Optional[str] = None  # the replica that ran its session's previous turn (sessions.py), when queued
    # (token offset, weights version) at each change of the weights its tokens come from: a segment
    # starts on its replica's version; an in-flight update (update_weights running=...) moves it
    weight_versions: list = field(default_factory=list)
    give_up_cause: Optional[str] = None  # why the router gave up its running segment, besides a move (a weights update)
    engine_errors: int = 0  # segments an engine ended with a retryable error, each continued (engine_error_retries)
    delivered_pull: int = -1  # the replica's pull whose reply carried the current attempt's Work
    give_up_pull: int = -1  # the replica's pull whose reply carried the give-up of the current attempt

    def resume(self, record_tokens: bool) -> None:
        """Start from the request's resumed output (a partial rollout an earlier batch cut off): a
        continuation from the start, as after a migration. Checked by validation.py."""
        out = self.request.output_token_ids
        self.generated = self.resumed = len(out)
        if record_tokens:  # (the simulator counts tokens without keeping them)
            self.token_ids = array("i", out)
            if self.request.sampling.logprobs is not None:
                self.logprobs = array("d", self.request.output_logprobs)

    @property
    def prompt_len(self) -> int:
        return self.request.prompt_len

    @property
    def max_tokens(self) -> int:
        return self.request.sampling.max_tokens

    @property
    def context_tokens(self) -> int:
        return self.request.prompt_len + self.generated

    @property
    def at_cap(self) -> bool:
        """It made all it may: max_tokens, or its hidden length (a benchmark's true length)."""
        hidden = self.request.hidden_length
        return self.generated >= self.max_tokens or (hidden is not None and self.generated >= hidden)

    @property
    def migratable(self) -> bool:
        return self.request.sampling.migratable


@dataclass
class GroupState:
    size: int
    finished: int = 0
    finished_len_max: int = 0
    finished_len_sum: int = 0

    @property
    def running(self) -> int:
        return self.size - self.finished


@dataclass(eq=False)
class ReplicaState:
    replica_id: str
    incarnation: str
    capacity: int
    joined_t: float
    last_pull_t: float
    stats: EngineStats = field(default_factory=EngineStats)
    seqs: SeqTable = field(default_factory=SeqTable)  # seq_id -> SeqState running (or giving up) here
    pulls: int = 0
    weights_version: int = 0  # what the replica reports holding
    # ... and where it came from ("": not said, the config's model): a number alone may name other
    # weights (one a replica cut off from a restarted router kept, which that router numbered again)
    weights_path: str = ""
    weights_ordered: Optional[int] = None  # the version a load_weights order is out for
    weights_order_sent: Optional[int] = None  # ... and the version of the last load order a pull's reply carried
    weights_noted: Optional[int] = None  # the version a note_weights order (asleep) is out for
    weights_loading: int = 0  # the version it reports loading now (0: none): its weights are about to change
    weights_loading_path: str = ""  # ... and its source ("": not said)
    weights_handed: dict = field(default_factory=dict)  # how its engine's load of them reached vLLM's worker (WeightsState.handed)
    last_report_number: int = 0  # Report.number of the newest report whose state was applied
    unknown_held: frozenset = frozenset()  # held attempts the router did not know at the last listing
    listed: bool = False  # it sent this router a listing of what it holds (Report.held)
    orphan_ids: frozenset = frozenset()  # seq ids of the attempts it held at that listing the router did not know
    # When it last showed progress: a report that carried a new token or a sequence's end, or the
    # dispatch of its first running sequence. Holding sequences with no progress for
    # router.stall_timeout_s is a stall (`stalled`).
    progress_t: float = 0.0

    def stalled(self, now: float, timeout_s: float) -> bool:
        """It holds running sequences and made no progress for longer than `timeout_s` (> 0)."""
        return bool(self.seqs) and now - self.progress_t > timeout_s

    @property
    def load(self) -> int:
        return len(self.seqs)

    @property
    def free_slots(self) -> int:
        return max(0, self.capacity - len(self.seqs))


class WorkQueue:
    """Queued sequences. Continuations (migrated, requeued) go before fresh work, and a
    continuation given up for a chosen destination waits in that replica's reserved lane."""

    def __init__(self):
        self.fresh: "OrderedDict[str, SeqState]" = OrderedDict()
        self.continuations: "OrderedDict[str, SeqState]" = OrderedDict()
        self.reserved: "dict[str, OrderedDict[str, SeqState]]" = {}
        self.fresh_by_group: "dict[tuple, OrderedDict[str, SeqState]]" = {}
        # session turns by their home replica (sessions.py), which has first claim on them: fresh
        # ones, and partial rollouts resumed in a new batch (continuations not yet run here)
        self.homed: "dict[str, OrderedDict[str, SeqState]]" = {}
        self._reserved_for: "dict[str, str]" = {}  # seq_id -> the replica whose lane holds it
        self.pushed = 0  # sequences pushed, ever: a change is work for held pulls (Serve's router wakes them)

    def __len__(self) -> int:  # every pull asks: O(1)
        return len(self.fresh) + len(self.continuations) + len(self._reserved_for)

    def push(self, seq: SeqState, reserved_for: Optional[str] = None) -> None:
        self.pushed += 1
        self.remove(seq)  # one lane holds a sequence (re-reserved elsewhere, or requeued): O(1)
        if reserved_for is not None:
            self.reserved.setdefault(reserved_for, OrderedDict())[seq.seq_id] = seq
            self._reserved_for[seq.seq_id] = reserved_for
        elif seq.generated > 0 or seq.attempt > 0:
            self.continuations[seq.seq_id] = seq
            if seq.home is not None and seq.attempt == 0:  # (a migrated one is not pulled back home)
                self.homed.setdefault(seq.home, OrderedDict())[seq.seq_id] = seq
        else:
            self.fresh[seq.seq_id] = seq
            self.fresh_by_group.setdefault(seq.group, OrderedDict())[seq.seq_id] = seq
            if seq.home is not None:
                self.homed.setdefault(seq.home, OrderedDict())[seq.seq_id] = seq

    def remove(self, seq: SeqState) -> None:
        sid = seq.seq_id
        if self.fresh.pop(sid, None) is not None:
            g = self.fresh_by_group.get(seq.group)
            if g is not None:
                g.pop(sid, None)
                if not g:
                    del self.fresh_by_group[seq.group]
            self._unhome(seq)
            return
        if self.continuations.pop(sid, None) is not None:
            self._unhome(seq)
            return
        rid = self._reserved_for.pop(sid, None)
        if rid is not None:
            lane = self.reserved[rid]
            lane.pop(sid, None)
            if not lane:
                del self.reserved[rid]

    def _unhome(self, seq: SeqState) -> None:
        if seq.home is not None:
            lane = self.homed.get(seq.home)
            if lane is not None:
                lane.pop(seq.seq_id, None)
                if not lane:
                    del self.homed[seq.home]

    def release_reserved(self, replica_id: str) -> None:
        """The destination is gone: its reserved continuations go back to the shared lane."""
        for seq in self.reserved.pop(replica_id, {}).values():
            self._reserved_for.pop(seq.seq_id, None)
            self.continuations[seq.seq_id] = seq

    def kept_for_homes(self, replicas: dict, puller: str) -> set:
        """Seq ids of session turns other replicas than `puller` leave to their home: as many of
        each live home's turns as it has free slots (it takes them at its next pull)."""
        kept = set()
        for rid, lane in self.homed.items():
            rep = replicas.get(rid)
            if rid == puller or rep is None:
                continue
            kept.update(islice(lane, rep.free_slots))
        return kept

    def unreserved(self):
        yield from self.continuations.values()
        yield from self.fresh.values()


@dataclass
class ClusterView:
    """What a policy sees at a decision. `now` is the only clock."""

    now: float
    queue: WorkQueue
    replicas: dict  # replica_id -> ReplicaState (alive only)
    groups: dict  # group -> GroupState
    seqs: dict  # seq_id -> SeqState (every live batch)
    expected_replicas: int
    finished_lengths: list  # lengths of recently finished sequences (a bounded window), in order
    generated_tokens: int = 0  # tokens generated so far (all batches)
    reprefill_tokens: int = 0  # tokens re-prefilled by migrations so far

    @property
    def running(self) -> int:
        return sum(len(r.seqs) for r in self.replicas.values())
