"""Messages between driver, router, policy and replicas.

Plain dataclasses only: they cross Ray's object store (pickled), the simulator's
event loop and the unit tests unchanged. Nothing here imports ray or vllm.
"""
from __future__ import annotations

import math
from array import array
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Optional, Union

from ..parsing import shown

# vLLM's engine core receives requests as MessagePack, whose integers are 64-bit, and seeds a
# torch.Generator, which takes 64 bits: a count or a seed must fit in a signed 64-bit integer.
INT64 = 2**63

MAX_N = 65536  # samples per prompt, at most (the config's limits.max_n lowers it)


class InputError(ValueError):
    """A request field has an invalid value. The message names the field and the value."""

    def __init__(self, field_name: str, value, why: str):
        super().__init__(f"{field_name}={shown(value)}: {why}")
        self.field = field_name

    def __reduce__(self):
        # Pickled across Ray (a router's refusal reaches the driver): pickle's default would call
        # the class with the message alone, and the driver would get a deserialization error.
        return _rebuilt_input_error, (type(self), self.args[0], self.field)


def _rebuilt_input_error(cls, message: str, field_name: str) -> InputError:
    error = cls.__new__(cls)
    ValueError.__init__(error, message)
    error.field = field_name
    return error


class WeightsVersionError(InputError):
    """A batch asked for weights (`weights_version`) other than those the fleet holds: it was not
    run, so that an RL step's samples all come from the policy the trainer meant."""


class LimitExceeded(RuntimeError):
    """A batch past one of the config's `limits` (HTTP 413: split it); nothing of it was
    registered. `limit` names the setting."""

    def __init__(self, limit: str, message: str):
        super().__init__(message)
        self.limit = limit

    def __reduce__(self):
        return type(self), (self.limit, self.args[0])


class RouterBusy(LimitExceeded):
    """The router holds limits.max_live_sequences already (HTTP 429): retry when batches finish."""


class BatchLostError(KeyError):
    """A batch the router does not hold because the router that ran it is gone: it restarted,
    and a batch's state lives in the router's memory. The driver still holds the requests and
    submits the sequences it has not received again (RolloutClient.max_router_restarts)."""


def is_int(v) -> bool:
    """An int, and not a bool (JSON's true is no count)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_int64(v) -> bool:
    """An int (not a bool) within a signed 64-bit integer."""
    return is_int(v) and -INT64 <= v < INT64


def is_number(v) -> bool:
    """A finite int or float, and not a bool: JSON's NaN and Infinity, a literal beyond a double's
    range (1e999) and true are no values for a sampling parameter."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int beyond a double
        return False


@dataclass(frozen=True)
class SamplingSpec:
    """Per-prompt sampling parameters; `n` samples share a group id."""

    n: int = 1
    max_tokens: int = 128
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability (0: disabled); per step, so exact across migration
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # None: no logprobs; k>=0: logprob of the sampled token (+k top)
    stop_token_ids: tuple = ()
    seed: Optional[int] = None
    repetition_penalty: float = 1.0  # counts prompt+output: exact across migration
    presence_penalty: float = 0.0  # counts output only: pins the sequence
    frequency_penalty: float = 0.0  # counts output only: pins the sequence
    # vLLM's prefix-cache namespace: a request reuses cached KV only from requests with the same
    # salt (tenants that must not share a cache; a run that must not reuse earlier KV)
    cache_salt: Optional[str] = None

    def validate(self) -> None:
        """Raise InputError naming the first field outside vLLM's own range (SamplingParams would
        refuse it inside the engine, after the router took the request) or of the wrong type."""
        if not is_int64(self.n) or self.n < 1:
            raise InputError("n", self.n, "must be an integer >= 1")
        if self.n > MAX_N:
            raise InputError("n", self.n, f"must be at most {MAX_N} (limits.max_n may lower it)")
        if not is_int64(self.max_tokens) or self.max_tokens < 1:
            raise InputError("max_tokens", self.max_tokens, "must be an integer >= 1")
        if not is_int64(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InputError("min_tokens", self.min_tokens, "must be an integer in [0, max_tokens]")
        if not is_number(self.temperature) or self.temperature < 0:
            raise InputError("temperature", self.temperature, "must be a finite number >= 0")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InputError("top_p", self.top_p, "must be a number in (0, 1]")
        if not is_int64(self.top_k) or self.top_k < -1:
            raise InputError("top_k", self.top_k, "must be an integer >= -1 (0 or -1: disabled)")
        if not is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InputError("min_p", self.min_p, "must be a number in [0, 1]")
        if not isinstance(self.ignore_eos, bool):
            raise InputError("ignore_eos", self.ignore_eos, "must be true or false")
        if self.logprobs is not None and (not is_int64(self.logprobs) or self.logprobs < 0):
            raise InputError("logprobs", self.logprobs, "must be null or an integer >= 0")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise InputError("stop_token_ids", self.stop_token_ids, "must be a list of integers >= 0")
        for t in self.stop_token_ids:
            if not is_int64(t) or t < 0:
                raise InputError("stop_token_ids", t, "every stop token id must be an integer >= 0")
        if self.seed is not None and not is_int64(self.seed):
            raise InputError("seed", self.seed, "must be null or an integer in [-2**63, 2**63)")
        if not is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InputError("repetition_penalty", self.repetition_penalty, "must be a finite number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_number(value) or not -2 <= value <= 2:
                raise InputError(name, value, "must be a number in [-2, 2]")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise InputError("cache_salt", self.cache_salt, "must be null or a non-empty string")

    @property
    def migratable(self) -> bool:
        """False where vLLM cannot be given the output-so-far state (DESIGN: pinned)."""
        return self.presence_penalty == 0 and self.frequency_penalty == 0

    def for_continuation(self, generated: int) -> "SamplingSpec":
        """The spec of a segment that continues after `generated` tokens."""
        return replace(
            self,
            n=1,
            max_tokens=self.max_tokens - generated,
            min_tokens=max(0, self.min_tokens - generated),
            seed=None if self.seed is None else self.seed + generated,
        )


@dataclass
class SequenceRequest:
    """One sample to generate: a prompt's sample `sample_index`."""

    prompt_token_ids: list
    sampling: SamplingSpec
    prompt_index: int
    sample_index: int
    # Benchmarks only: the true response length. Only the engine adapter acts on it (it stops
    # the sequence there); the policy never reads it.
    hidden_length: Optional[int] = None
    # Simulation may omit the token ids and give only their number.
    prompt_len: int = -1
    # A partial rollout resumed (Partial): the tokens this sample generated in an earlier batch that
    # was cut off (generate's finish_fraction), and their logprobs. It continues after them, as a
    # migrated sequence does; `sampling.max_tokens` counts them, and its Completion starts with them.
    output_token_ids: Optional[list] = None
    output_logprobs: Optional[list] = None
    # A multi-turn session this request is a turn of (an agent's conversation): the router prefers
    # the replica that ran the session's previous turn, whose prefix cache holds the shared prefix.
    session: Optional[str] = None

    def __post_init__(self):
        if self.prompt_len < 0:
            self.prompt_len = len(self.prompt_token_ids)


@dataclass
class Partial:
    """A sample cut off before its end (finish_reason "abort": generate's finish_fraction, cancel),
    to continue in a later batch: pass it among a batch's prompts, where it stands for one sequence.
    Partial rollouts: an RL step need not wait for its longest samples; they finish in the next
    step, on newer weights for the tokens still to come (Completion.resumed_tokens says where)."""

    prompt_token_ids: list
    token_ids: list
    logprobs: Optional[list] = None


def partials(prompts: list, completions: list) -> list:
    """The Partial of every completion that was cut off ("abort"), in order: `prompts` is what the
    batch was given (token lists, or Partials, whose prompt is then the original one)."""
    out = []
    for c in completions:
        if c.finish_reason != "abort":
            continue
        item = prompts[c.prompt_index]
        prompt = item.prompt_token_ids if isinstance(item, Partial) else list(item)
        out.append(Partial(prompt, list(c.token_ids), None if c.logprobs is None else list(c.logprobs)))
    return out


@dataclass(frozen=True)
class Migration:
    """A segment boundary where the sequence left `source` and continued with prompt + partial."""
    source: str
    destination: Optional[str]  # None until the continuation starts somewhere
    at_token: int
    time_s: float  # seconds since the batch was submitted
    # "policy": the policy moved it. "replica_left": Serve stopped its replica, which handed it
    # back with every token. "replica_lost": its replica died or restarted; it continued from its
    # last reported tokens (what the replica made after its last report was generated again).
    # "router_restart": the router that ran it restarted; the new one took over its output so far.
    # "weights_update": an update with running="recompute" gave it up. "report_gap": a report of
    # its replica skipped tokens; it continued from the tokens the router held.
    reason: str = "policy"


def _as_list(values):
    """An array (the router's compact storage) as a list; anything else unchanged."""
    return values.tolist() if isinstance(values, array) else values


@dataclass
class Completion:
    prompt_index: int
    sample_index: int
    token_ids: list
    logprobs: Optional[list]
    finish_reason: str
    error: Optional[str] = None
    replicas: list = field(default_factory=list)
    migrations: list = field(default_factory=list)
    batch_id: str = ""
    index: int = -1  # position in the submitted batch
    finish_time_s: float = 0.0  # seconds from the batch's submission to this sequence's end
    weights_version: int = 0  # the weights every segment ran with (RolloutClient.update_weights)
    # A resumed Partial: its first `resumed_tokens` tokens (and logprobs) came with the request,
    # generated in an earlier batch, maybe on older weights; `weights_version` is the rest's.
    resumed_tokens: int = 0
    # Which weights made which tokens: [offset, version] at each change, from its first generated
    # token on (after `resumed_tokens`). One entry unless the weights were updated while it ran
    # (update_weights / push_weights with running="recompute" or "keep").
    weight_versions: list = field(default_factory=list)

    def with_lists(self) -> "Completion":
        """This completion with plain lists: the router keeps finished tokens in compact arrays
        until they are fetched."""
        return replace(self, token_ids=_as_list(self.token_ids), logprobs=_as_list(self.logprobs))

    def to_json(self) -> dict:
        return {
            "prompt_index": self.prompt_index,
            "sample_index": self.sample_index,
            "token_ids": list(self.token_ids),
            "logprobs": None if self.logprobs is None else list(self.logprobs),
            "finish_reason": self.finish_reason,
            "error": self.error,
            "replicas": list(self.replicas),
            "migrations": [m.__dict__ for m in self.migrations],
            "finish_time_s": round(self.finish_time_s, 4),
            "weights_version": self.weights_version,
            "resumed_tokens": self.resumed_tokens,
            "weight_versions": [list(v) for v in self.weight_versions],
        }


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

    def __post_init__(self):
        if self.prompt_len < 0:
            self.prompt_len = len(self.prompt_token_ids)


@dataclass
class SeqProgress:
    """Replica -> router: what one segment produced since the last report (a delta)."""

    seq_id: str
    attempt: int
    token_ids: list
    logprobs: Optional[list] = None
    finish_reason: Optional[str] = None  # set on the segment's one final report
    error: Optional[str] = None
    num_tokens: int = -1  # simulation reports counts without ids
    # vLLM, on a segment's first report: prompt tokens it found in its prefix cache (-1: not known).
    # For a continuation the router counts the rest as re-prefilled for real.
    cached_tokens: int = -1
    # Tokens of this attempt reported before this delta (-1: not tracked). A report the router
    # applied but whose reply was lost comes again; the router drops what it already has.
    offset: int = -1
    # A final report of the whole output (Orders.report_whole): the segment's prompt, which is the
    # sequence's prompt and, for a continuation, the tokens of its earlier segments.
    prompt_token_ids: Optional[list] = None
    # ... and, for a continuation that asked for logprobs, those of the prompt's generated tail
    prior_logprobs: Optional[list] = None
    # Weights swapped while this attempt ran (LoadWeights.keep): (offset, version) pairs, the
    # attempt's tokens from `offset` on made by `version`. Sent with every report after the swap.
    swaps: Optional[list] = None

    def __post_init__(self):
        if self.num_tokens < 0:
            self.num_tokens = len(self.token_ids)


@dataclass
class ModelInfo:
    """What the engine serves, sent on a replica's first report: the router checks requests against it."""

    vocab_size: int  # token ids must lie in [0, vocab_size)
    max_model_len: int  # prompt + max_tokens must fit
    model: str = ""  # the model's path or name, for status
    max_logprobs: int = 20  # SamplingSpec.logprobs must not exceed it (vLLM's max_logprobs; its default)
    # The highest temperature the engine's SamplingParams takes (None: no limit). vLLM releases
    # differ: newer ones refuse temperature > 2, as OpenAI's API does (vllm_engine.py probes it).
    max_temperature: Optional[float] = None


@dataclass
class EngineStats:
    """A replica's engine as it runs now: what the policy's cost model reads."""

    running: int = 0  # sequences the engine holds
    context_tokens: int = 0  # prompt + generated tokens of every sequence held
    step_time_s: float = 0.0  # recent mean decode step time
    # Decode tokens per second per running sequence, an EMA over report intervals that counts
    # intervals with no tokens too: unbiased when tokens arrive in stream_interval chunks.
    seq_tokens_per_s: float = 0.0


@dataclass
class WeightsState:
    """A replica's weights, as its engine holds them (router/weights.py reads it)."""

    version: int = 0  # the version the engine holds (0: the config's model)
    path: str = ""  # where `version` came from ("": the config's model)
    loading: int = 0  # the version being loaded now (0: none)
    error: Optional[str] = None  # why the last LoadWeights failed, until one succeeds
    error_version: int = 0  # the version that failed load was for (an older error is stale)
    # A NoteWeights made while the engine sleeps, which it loads at wake (0: none). The replica holds
    # it, so that a router that restarts during the sleep learns it back.
    noted: int = 0
    noted_path: str = ""


@dataclass
class SleepState:
    """A replica's vLLM sleep mode (router/sleep.py reads it)."""

    level: int = 0  # the level its engine is at (0: awake)
    goal: int = 0  # the level the router last told it to reach (the two differ while it moves)
    error: Optional[str] = None  # why reaching `goal` failed


@dataclass
class Listing:
    """Every attempt a replica's engine holds, sent every few seconds: the router requeues work it
    sent in a reply the replica never received, and gives up attempts it does not know."""

    held: list[tuple[str, int]] = field(default_factory=list)  # (seq_id, attempt) the engine runs
    # Of those, the attempts already told to give up, whose abort is on its way. A held attempt not
    # in it after a give-up was sent means the give-up never arrived.
    aborting: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class Report:
    """Replica -> router, on every pull. Built by keyword."""

    replica_id: str
    incarnation: str  # changes when the replica restarts: the router drops its old state
    _: KW_ONLY
    progress: list[SeqProgress] = field(default_factory=list)  # deltas (or whole finals) since the last report
    stats: EngineStats = field(default_factory=EngineStats)
    model: Optional[ModelInfo] = None  # on the first report (and goodbyes leave it out)
    capacity: int = 0  # most sequences the engine runs at once (max_num_seqs)
    weights: WeightsState = field(default_factory=WeightsState)
    sleep: SleepState = field(default_factory=SleepState)
    listing: Optional[Listing] = None  # every few seconds; None in between
    # The replica is shutting down (Serve scales it down or replaces it): it gave up everything it
    # held and this report carries the final partials. The router requeues its work at once
    # instead of after router.replica_timeout_s, and sends it nothing more.
    leaving: bool = False
    # With `leaving`: the replica's engine died (vLLM's EngineCore crashed), so Serve replaces the
    # replica. The router counts it as a death, not a scale-down: the fleet's size does not change.
    engine_dead: bool = False
    # Counts up with every report the replica builds (0: not counted). A report the router gets
    # after a newer one (a pull it processed late) has its progress applied, not its state.
    number: int = 0
    # The answer to the last DigestWeights, until a pull delivered it (None: none to send)
    digest: Optional[WeightsDigest] = None
    # The secret the router gave this replica when it registered (Router.register): a report
    # without it is not applied, so no other caller can speak for the replica.
    credential: str = field(default="", repr=False)


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
    block is the same KV the engine would compute, so outputs do not. `number` tells two orders apart."""

    number: int


@dataclass(frozen=True)
class DigestWeights:
    """Send a digest of the engine's weights (RolloutClient.weights_digest) in a report, taken after
    the moves under way. `ask` names the request (a resent order starts nothing); `detail`: every
    parameter's digest too."""

    ask: str
    detail: bool = False


@dataclass
class WeightsDigest:
    """Replica -> router (Report.digest): the answer to DigestWeights `ask`."""

    ask: str
    version: int  # the weights version the engine held for the whole digest (no load ran meanwhile)
    digest: str = ""  # over every parameter (engines/weight_digest.py); "" with `error`
    params: Optional[dict] = None  # with `detail`: {name: {"digest", "dtype", "shape"}}
    error: Optional[str] = None  # why there is none: the engine sleeps, a load ran meanwhile, it failed
    seconds: float = 0.0  # how long the engine took


ControlOrder = Union[LoadWeights, NoteWeights, Sleep, Wake, ResetPrefixCache, DigestWeights]


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
