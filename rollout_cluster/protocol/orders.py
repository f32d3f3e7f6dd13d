"""Router -> replica: Orders, the answer to a pull. Work (a segment of a sequence to run), the
attempts to give up, and the control orders applied before new work (LoadWeights, NoteWeights,
Sleep, Wake, ResetPrefixCache, DigestWeights).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from .requests import SamplingSpec


# ---- router <-> replica protocol -------------------------------------------------------


@dataclass
class Work:
    """Router -> replica: run one segment of a sequence."""

    seq_id: str
    attempt: int
    prompt_token_ids: Optional[list]  # original prompt + tokens generated so far (None in simulation)
    sampling: SamplingSpec  # already reduced for the tokens generated so far
    stop_after: Optional[int] = None  # hidden length left, or a policy's segment cap
    prompt_len: int = -1
    # The shared prompt, for the simulator's prefix cache (the vLLM engine has its own cache and
    # ignores both): the group (batch_id, prompt index) whose first `prefix_len` tokens (the
    # original prompt) this segment's prompt starts with. None: shares nothing.
    prefix_key: Optional[tuple] = None
    prefix_len: int = 0
    # A continuation that asks for logprobs (not a chunked round's): those of the tokens generated
    # before this segment (the prompt's tail, an array of doubles), kept only to go into a whole
    # final report (Orders.report_whole), so that a restarted router takes the sequence over with
    # every logprob. Not used to generate.
    prior_logprobs: Optional[object] = None
    # (offset, version) at each change of the weights the sequence's tokens came from, up to this
    # segment's own start (the last pair): offsets count its generated tokens. Not used to
    # generate: it goes back in a whole final report, so that a restarted router labels what it
    # takes over with the versions that made it (router/adoption.py), not with its own.
    weight_versions: Optional[list] = None

    def __post_init__(self):
        if self.prompt_len < 0:
            self.prompt_len = len(self.prompt_token_ids)


# ---- router -> replica: control orders, applied in order before `Orders.start` -----------------


@dataclass(frozen=True)
class LoadWeights:
    """Load the checkpoint at `path` into the running engine as `version` (update_weights), or the
    pushed tensors in `buckets` (push_weights; `path` then names the push, "push://<id>")."""

    path: str
    version: int
    # push_weights: the tensors' buckets (transfer/buckets.py) as object-store handles, in order
    buckets: Optional[tuple] = None
    # update_weights(running="keep"): swap between engine steps while sequences run; they continue
    # on the KV cache they have, and each one's progress says from which token the new weights made it
    keep: bool = False


@dataclass(frozen=True)
class NoteWeights:
    """The fleet's weights changed while this engine sleeps: load `path` at wake, and report it."""

    path: str
    version: int
    buckets: Optional[tuple] = None  # pushed weights: as LoadWeights.buckets


@dataclass(frozen=True)
class Sleep:
    """Put the engine to sleep at vLLM's `level` (1: weights to host memory; 2: dropped)."""

    level: int


@dataclass(frozen=True)
class Wake:
    """Wake the engine; a level-2 sleeper first reloads `path` as `version` (None: the config's model)."""

    path: Optional[str]
    version: int
    buckets: Optional[tuple] = None  # pushed weights: as LoadWeights.buckets


@dataclass(frozen=True)
class ResetPrefixCache:
    """Drop the engine's prefix cache (TRL's /reset_prefix_cache). Only speed changes: a cached
    block is the same KV the engine would compute, so outputs do not."""

    number: int  # counts the orders of the router that made it (a resent one carries the same)
    router: str = ""  # that router's id prefix: a restarted router counts from 1 again, and its orders are new


@dataclass(frozen=True)
class DigestWeights:
    """Send a digest of the engine's weights (RolloutClient.weights_digest) in a report, taken after
    the moves under way. `ask` names the request (a resent order starts nothing); `detail`: every
    parameter's digest too."""

    ask: str
    detail: bool = False


@dataclass(frozen=True)
class StopPush:
    """The push `path` ended before its last objects came (its trainer aborted it, push_abort; the
    fleet went back to the weights it held before): a load of it stops at once, and one that had
    begun replacing the engine's weights reloads those the replica held before; a note of it is
    dropped."""

    path: str  # the push ("push://<id>")
    reason: str  # why it ended, the trainer's words (in the load's error)


ControlOrder = Union[LoadWeights, NoteWeights, Sleep, Wake, ResetPrefixCache, DigestWeights, StopPush]


@dataclass
class Orders:
    """Router -> replica, the answer to a pull."""

    start: list[Work] = field(default_factory=list)  # segments to run
    give_up: list[tuple[str, int]] = field(default_factory=list)  # (seq_id, attempt) to abort
    # Of those given up: attempts whose final report must carry their whole output (offset 0), not
    # a delta. A restarted router asks it of its predecessor's segments, to continue them.
    report_whole: list[tuple[str, int]] = field(default_factory=list)
    control: list[ControlOrder] = field(default_factory=list)  # applied in order, before `start`
    # Work is queued at the router: a slot freed by an ending segment is worth reporting at once.
    work_waiting: bool = False
    # How often to report while running sequences (RouterConfig.report_interval_for the fleet); 0: the config's.
    report_interval_s: float = 0.0
    # Which router answers: after a restart the replica sends the old one's segments' finals whole.
    router_id: str = ""
    # The router does not know the report's credential (it restarted, or the replica never
    # registered): nothing of the report was applied; register, then send it again.
    register: bool = False
    # Non-empty (why): the router declared this replica stalled (its running sequences made no
    # progress for router.stall_timeout_s) and continues its work elsewhere; the replica stops
    # pulling, hands nothing back, and fails its health check, so that Serve replaces it.
    stop: str = ""

    def __bool__(self) -> bool:
        return bool(self.start or self.give_up or self.control or self.report_whole or self.stop)
