"""Replica -> router: a Report on every pull, with each segment's SeqProgress, the engine's
ModelInfo, EngineStats, WeightsState, SleepState, the Listing of attempts it holds, and the
WeightsDigest a DigestWeights asked for. Built by keyword.
"""
from __future__ import annotations

from dataclasses import KW_ONLY, dataclass, field
from typing import Optional

from .checks import is_int


@dataclass
class SeqProgress:
    """Replica -> router: what one segment produced since the last report (a delta)."""

    seq_id: str
    attempt: int
    token_ids: list
    logprobs: Optional[list] = None
    finish_reason: Optional[str] = None  # set on the segment's one final report
    error: Optional[str] = None
    # A final "error" that the engine calls retryable: a request-level failure inside it (vLLM's
    # finish_reason "error": a KV load that failed, a cache miss), not the request's own fault. The
    # router continues the sequence from its tokens so far, up to router.engine_error_retries times.
    retryable: bool = False
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
    # ... and, on a whole final, its Work's weight_versions: the versions of the prompt's generated
    # tail, and the one this segment started on
    weight_versions: Optional[list] = None

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
    loading_path: str = ""  # ... and its source: a restarted router may number other weights the same
    error: Optional[str] = None  # why the last LoadWeights failed, until one succeeds
    error_version: int = 0  # the version that failed load was for (an older error is stale)
    error_path: str = ""  # ... and its source ("": not said): a restarted router may number other weights the same
    # A NoteWeights made while the engine sleeps, which it loads at wake (0: none). The replica holds
    # it, so that a router that restarts during the sleep learns it back.
    noted: int = 0
    noted_path: str = ""
    # How the load of `version` handed its buckets to vLLM's worker: way -> buckets, the ways
    # engines/weight_loader.WAYS ("store": read where it lies in Ray's object store, "slot": copied
    # into a /dev/shm slot, "file", "bytes", "ipc"); {}: none counted (vLLM read a checkpoint
    # itself, a simulated engine, a replica older than this field)
    handed: dict = field(default_factory=dict)

    # How many objects it knows of the push it loads (else of the one noted; 0: not said, or no push):
    # fewer than the router's last order of it named, and that order was lost with its reply: sent again.
    objects: int = 0
    # The last push a StopPush ended here (its trainer aborted it): the router sends the StopPush
    # again while the replica reports it loads or noted an aborted push and not this ("": none)
    stopped: str = ""

    def handed_counts(self) -> dict[str, int]:
        """`handed` as the router keeps it: its (str, non-negative int) items; {} where a report
        lacks the field (pickled by an older replica) or it is no dict."""
        handed = getattr(self, "handed", None)
        if not isinstance(handed, dict):
            return {}
        return {k: v for k, v in handed.items() if isinstance(k, str) and is_int(v) and v >= 0}


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


@dataclass
class WeightsDigest:
    """Replica -> router (Report.digest): the answer to DigestWeights `ask`."""

    ask: str
    version: int  # the weights version the engine held for the whole digest (no load ran meanwhile)
    digest: str = ""  # over every parameter (engines/weight_digest.py); "" with `error`
    params: Optional[dict] = None  # with `detail`: {name: {"digest", "dtype", "shape"}}
    error: Optional[str] = None  # why there is none: the engine sleeps, a load ran meanwhile, it failed
    seconds: float = 0.0  # how long the engine took
