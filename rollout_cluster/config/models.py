"""The config's sections as pydantic models: the one place where defaults live.

Each field's `description` is its documentation (docs/configuration.md is generated from them),
its constraints are its rule, and a rule between fields is a model validator that names its
field's `also` text. Models are strict (strict_model.py): an int field refuses a bool and a
string, a float field takes an int, a bool field takes only a bool; floats are finite, integers
within 64 bits; unknown keys are refused.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Optional, Union

from pydantic import Discriminator, Field, Tag, ValidationError, model_validator

from ..policy.registry import DEFAULT_POLICY, REGISTRY
from ..strict_model import StrictModel
from .errors import FieldRuleError, config_error


def _also(rule: str) -> dict:
    """A rule between fields, as its model validator words it after 'must be'."""
    return {"json_schema_extra": {"also": rule}}


class Section(StrictModel):
    def _require(self, key: str, ok: bool, note: str = "") -> None:
        """Refuse `key` (a path below this model) unless `ok`, with its field's `also` rule."""
        if ok:
            return
        owner, name = self, key
        while "." in name:
            head, name = name.split(".", 1)
            owner = getattr(owner, head)
        raise FieldRuleError(key, getattr(owner, name), type(owner).model_fields[name].json_schema_extra["also"] + note)


class EngineConfig(Section):
    kind: Literal["vllm", "sim"] = Field("vllm", description="vllm | sim")
    model: str = Field("models/tiny-llama", min_length=1, description="local path or HF id")
    load_format: str = Field("auto", description="auto | dummy | safetensors | ...")
    dtype: Literal["auto", "bfloat16", "float16", "half", "float32", "float"] = Field(
        "auto", description="vLLM dtype (the names vLLM takes; half = float16, float = float32)")
    max_model_len: int = Field(4096, ge=2, description="context limit per sequence (prompt + output)")
    max_num_seqs: int = Field(256, ge=1, description="set always: AsyncLLM's defaults are smaller than LLM's")
    max_num_batched_tokens: int = Field(8192, ge=1, description=(
        "vLLM scheduler: tokens per step; set always (AsyncLLM defaults to 2048)"),
        **_also(">= engine.max_num_seqs"))
    tensor_parallel_size: int = Field(1, ge=1, description=(
        "GPUs per replica's engine; > 1: one worker process per rank, on the replica's GPUs (one node)"))
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description=(
        "fraction of GPU memory vLLM may take (weights + KV cache)"))
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = Field("raw_logprobs", description=(
        "which logprobs the engines return: of the model's logits (vLLM's default), or after temperature and "
        "top-k/top-p (the sampling distribution: what an importance-sampling correction needs)"))
    enable_prefix_caching: bool = Field(True, description=(
        "vLLM prefix caching; makes a migrated sequence's re-prefill cheaper for its siblings"))
    enforce_eager: bool = Field(False, description="disable CUDA graphs (faster start, slower decode)")
    # The CPU build has no CuMem allocator: there sleep() only pauses the engine.
    enable_sleep_mode: bool = Field(False, description=(
        "GPU: vLLM sleep mode, so RolloutClient.sleep frees the GPUs' memory for a trainer beside the engines"))
    seed: int = Field(0, description="engine seed (per-request seeds come with the SamplingSpec)")
    stream_interval: int = Field(8, ge=1, description=(
        "tokens between progress deltas: per-token streaming of hundreds of requests costs the engine's process"))
    # Ray starts workers at nice 15 (RAY_worker_niceness) so that raylet and GCS stay responsive;
    # an engine inheriting that loses its core to any nice-0 process.
    niceness: Optional[int] = Field(0, ge=-20, le=19, description=(
        "the replica's engine thread and processes run at this niceness (null: keep Ray's 15)"))
    # Ray sets OMP_NUM_THREADS = resources.num_cpus in its workers; a bare AsyncLLM has none set.
    omp_num_threads: Optional[int] = Field(None, ge=1, description=(
        "GPU engines: OMP_NUM_THREADS of the engine's processes (torch's CPU threads); null: unset, as "
        "a bare AsyncLLM's (the replica removes the value Ray gives its workers). Not used on the CPU build"))
    cpu_kv_cache_gib: int = Field(1, gt=0, description="VLLM_CPU_KVCACHE_SPACE in GiB (CPU build only)")
    cpu_bind_cores: bool = Field(True, description="pin replica k to core k (VLLM_CPU_OMP_THREADS_BIND)")
    sim_profile: str = Field("a100-80g-7b", description="kind=sim: built-in profile name or YAML file", **_also(
        "a built-in profile or an existing file (rollout-cluster calibrate makes one)"))
    sim_vocab_size: int = Field(32000, ge=1, description="kind=sim: token ids are drawn below this")
    sim_time_scale: float = Field(1.0, gt=0, description=(
        "kind=sim: wall seconds per modelled second (>1: slower than modelled, less host CPU a second)"))


_RAY_UNIT = "0 or >= 0.0001 (Ray's finest fraction of a resource)"


class ReplicaResources(Section):
    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs per replica", **_also(_RAY_UNIT))
    num_gpus: float = Field(0.0, ge=0, description=(
        "Ray GPUs per replica (0 on the CPU build); a fraction shares a GPU (with a trainer) at "
        "tensor_parallel_size 1, a tensor-parallel replica takes at least one per rank"), **_also(_RAY_UNIT))

    @model_validator(mode="after")
    def _rules(self) -> "ReplicaResources":
        for key in ("num_cpus", "num_gpus"):
            value = getattr(self, key)
            self._require(key, value == 0 or value >= 1e-4)
        return self


# A replica reports an urgent segment end (work queued for the slot, a give-up's partials) no
# sooner than this fraction of the report interval after its last report: it pulls at most twice
# an interval, and a fleet past router.max_pulls_per_s stays within twice that while work is queued.
URGENT_REPORT_GAP_FRAC = 0.5

_WITHIN_TIMEOUT = "<= min(5, router.replica_timeout_s / 4)"  # a slower report would look like a dead replica


class RouterConfig(Section):
    pull_wait_s: float = Field(0.05, gt=0, le=5, description=(
        "long-poll of a replica that runs sequences: orders at once, else after this"), **_also(_WITHIN_TIMEOUT))
    idle_pull_wait_s: float = Field(1.0, gt=0, description=(
        "long-poll of a replica that holds nothing: new work wakes it at once"), **_also(_WITHIN_TIMEOUT))
    report_interval_s: float = Field(0.2, gt=0, description=(
        "a replica that runs sequences reports this often, and at once when one ends"), **_also(_WITHIN_TIMEOUT))
    max_pulls_per_s: float = Field(160.0, gt=0, description=(
        "periodic reports and idle long-polls stay near this many a second: their interval grows with the fleet"))
    replica_timeout_s: float = Field(60.0, gt=0, description=(
        "no pull for this long: the replica is dead, requeue its work"))
    # A healthy busy replica reports a token at least every report interval (at most min(5,
    # replica_timeout_s / 4)): twice that is the least timeout that cannot take one for stalled.
    stall_timeout_s: float = Field(120.0, ge=0, description=(
        "a replica that holds running sequences and reports no new token for this long has stalled: its work "
        "continues elsewhere and it fails its health check (Serve replaces it); 0: never"),
        **_also("0 (never) or >= twice the longest report interval, 2 x min(5, router.replica_timeout_s / 4)"))
    engine_error_retries: int = Field(2, ge=0, le=100, description=(
        "a sequence that an engine ends with a retryable error (vLLM's finish_reason \"error\": a request-level "
        "failure inside the engine, such as a KV load that failed) continues from its tokens so far, at most this "
        "many times; the next such error ends it with finish_reason \"error\" (0: never retried)"))
    max_sessions: int = Field(65536, ge=0, description=(
        "multi-turn sessions whose last replica the router remembers (session affinity; least recently used "
        "forgotten first; 0: no affinity)"))
    max_ongoing_requests: int = Field(4096, description=">> replicas + drivers: pulls must never queue", **_also(
        ">= replicas + 8, above replicas + drivers, or pulls queue behind each other"))
    submit_wait_for_replica_s: float = Field(600.0, ge=0, description="a submit with no live replica fails after this")
    # 0 makes decisions prompt where engines keep every core busy, at the price of engine time
    # (2-core CPU cluster, experiments/cpu-two-replicas: steal's decision p99 43 -> 2.2 ms, no makespan gain).
    niceness: Optional[int] = Field(None, ge=-20, le=19, description=(
        "the router's, the Gateway's and Serve's HTTP proxy's threads run at this niceness (null: keep Ray's 15)"))
    # A driver's fetch long-polls the router for up to a second (client/follower.py FETCH_WAIT_S):
    # a bound at or below that takes every quiet fetch for a dead router.
    call_timeout_s: float = Field(120.0, ge=5, description="bound on every driver -> router call")
    abandoned_batch_s: float = Field(900.0, description=(
        "a batch no driver fetched from for this long (its driver died) is cancelled and dropped; 0: never"),
        **_also("0 (never) or >= 10: drivers fetch about once a second"))
    # A fetch's answer can be lost (the driver's call timed out on a slow reply): its retry, from the
    # same cursor, must get the same completions. A driver that got them fetches once more from the
    # batch's end, which releases it at once; this bounds how long one that never does is waited for.
    # Three call timeouts cover the lost call, the retry and a slow router; the batch's results are
    # held in the meantime, as they were while it ran.
    finished_batch_keep_s: float = Field(360.0, description=(
        "a batch fetched whole is kept this long for a retry of that fetch (its answer lost), unless its driver "
        "fetches from its end first"), **_also(">= router.call_timeout_s"))

    @model_validator(mode="after")
    def _rules(self) -> "RouterConfig":
        ceiling = min(5.0, self.replica_timeout_s / 4)
        self._require("pull_wait_s", self.pull_wait_s <= ceiling, f" = {ceiling:g}")
        self._require("idle_pull_wait_s", self.idle_pull_wait_s <= ceiling, f" = {ceiling:g}")
        self._require("report_interval_s", self.report_interval_s <= ceiling, f" = {ceiling:g}")
        self._require("abandoned_batch_s", self.abandoned_batch_s == 0 or self.abandoned_batch_s >= 10)
        self._require("finished_batch_keep_s", self.finished_batch_keep_s >= self.call_timeout_s,
                      f" = {self.call_timeout_s:g}")
        self._require("stall_timeout_s", self.stall_timeout_s == 0 or self.stall_timeout_s >= 2 * ceiling,
                      f" = {2 * ceiling:g}")
        return self

    def report_interval_for(self, replicas: int) -> float:
        """The report interval a fleet of `replicas` live replicas is told to use: report_interval_s,
        or replicas / max_pulls_per_s when that is longer, at most min(5, replica_timeout_s / 4)
        (a slower report would look like a dead replica)."""
        return self._per_fleet(self.report_interval_s, replicas)

    def idle_pull_wait_for(self, replicas: int) -> float:
        """How long the router holds an idle replica's pull in a fleet of `replicas`: the same rule
        from idle_pull_wait_s. Holding longer costs no latency (new work wakes a held pull), and
        a fleet idle between RL steps then pulls max_pulls_per_s times a second, not once a
        second per replica."""
        return self._per_fleet(self.idle_pull_wait_s, replicas)

    def _per_fleet(self, base_s: float, replicas: int) -> float:
        ceiling = max(base_s, min(5.0, self.replica_timeout_s / 4))
        return min(ceiling, max(base_s, replicas / self.max_pulls_per_s))


def _policy_name(value) -> Optional[str]:
    """The name the policy union dispatches on: a mapping without one is the default policy's."""
    return value.get("name", DEFAULT_POLICY) if isinstance(value, dict) else getattr(value, "name", None)


# `policy:` is the settings model of the policy it names (policy/registry.py).
PolicyUnion = Annotated[Union[tuple(Annotated[e.settings, Tag(name)] for name, e in REGISTRY.items())],
                        Discriminator(_policy_name)]


class SamplingDefaults(Section):
    """Defaults for what a request leaves out: a JSONL line's missing fields (`rollout-cluster
    generate`, the Ray job, POST /<app>/generate), and `RolloutClient.generate` / `stream` called
    without `sampling`. A field the line or the SamplingSpec sets wins."""

    max_tokens: int = Field(256, ge=1, description="output cap per sequence; must stay below engine.max_model_len",
                            **_also("< engine.max_model_len"))
    temperature: float = Field(1.0, ge=0, description="sampling temperature (0: greedy)")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling threshold")

    def spec_fields(self) -> dict:
        """The SamplingSpec fields these set."""
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p}


class MetricsConfig(Section):
    port: int = Field(0, ge=0, le=65535, description="0: no HTTP endpoint")


class SecurityConfig(Section):
    """Who may use the app (docs/security.md). Secrets never travel in the config: it names where
    they are (a file, as a Kubernetes Secret mounts it, or an environment variable), and each
    process reads them there (security/secrets.py)."""

    token_file: str = Field("", description=(
        "file holding the bearer token every HTTP route but the liveness ones (/healthz, /health, /health/) asks "
        "for (a mounted Secret)"))
    token_env: str = Field("ROLLOUT_TOKEN", description="environment variable holding the token when token_file is empty")
    allow_unauthenticated: bool = Field(False, description=(
        "true: serve HTTP without a token when none is configured (else the app refuses to start)"))
    control_keys_file: str = Field("", description=(
        "file of HMAC keys for control orders, one `key_id secret` a line; the first signs, up to two verify (rotation)"))
    control_keys_env: str = Field("ROLLOUT_CONTROL_KEYS", description=(
        "environment variable holding the keys (lines or `;`-separated) when control_keys_file is empty"))
    allow_unsigned_control: bool = Field(False, description=(
        "true: accept unsigned control orders when no key is configured (else the router refuses to start)"))
    max_clock_skew_s: float = Field(30.0, gt=0, le=300, description=(
        "a signed order issued further than this from the router's clock is refused; nonces are kept this long"))
    checkpoint_roots: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list, description=(
        "update_weights paths must resolve (realpath) under one of these folders (each non-empty); empty list: every "
        "update is refused"))
    http_weight_updates: bool = Field(False, description=(
        "true: the Gateway serves TRL's and vLLM's weight routes (/init_communicator/, /update_weights, ...): "
        "whoever holds the bearer token may replace the served weights (docs/trainers.md)"))
    require_manifest: bool = Field(True, description=(
        "a checkpoint loads only with its rollout-manifest.json, every file present at its recorded size"))


class LimitsConfig(Section):
    """Bounds on what one caller can ask for; each refusal names its limit."""

    max_body_bytes: int = Field(64 * 2**20, ge=1024, description="POST body bytes (413 past it, read as a stream)")
    max_lines: int = Field(65536, ge=1, description="JSONL lines per HTTP batch (413 past it)")
    max_n: int = Field(1024, ge=1, le=65536, description="samples per prompt (n) on a line or in a SamplingSpec")
    max_batch_sequences: int = Field(262144, ge=1, description="sequences (prompts x n) in one batch")
    max_live_sequences: int = Field(1048576, ge=1, description=(
        "sequences the router holds across every live batch; a batch past it is refused with 429 and Retry-After"),
        **_also(">= limits.max_batch_sequences"))
    retry_after_s: int = Field(5, ge=1, le=3600, description="the Retry-After a 429 carries")
    max_timeout_s: float = Field(86400.0, gt=0, description="a batch's timeout_s must be in (0, this]")
    max_queued_requests: int = Field(256, ge=1, description=(
        "HTTP requests Serve queues at the Gateway beyond those it runs (503 past it)"))

    @model_validator(mode="after")
    def _rules(self) -> "LimitsConfig":
        self._require("max_live_sequences", self.max_live_sequences >= self.max_batch_sequences,
                      f" = {self.max_batch_sequences}")
        return self


class ClusterConfig(Section):
    app_name: str = Field("rollout", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$", description=(
        "Serve application name (letters, digits, _ . -; at most 64, a letter or digit first), also its route "
        "prefix (/<app_name>); drivers connect with `RolloutClient.connect(app_name=...)`"))
    replicas: int = Field(2, ge=1, description="number of EngineReplica deployments, one vLLM engine each")
    engine: EngineConfig = Field(default_factory=EngineConfig)
    resources: ReplicaResources = Field(default_factory=ReplicaResources)
    router: RouterConfig = Field(default_factory=RouterConfig)
    policy: PolicyUnion = Field(default_factory=REGISTRY[DEFAULT_POLICY].settings, description=(
        "which policy schedules; the other keys under `policy:` are its settings"))
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    sampling: SamplingDefaults = Field(default_factory=SamplingDefaults)
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    base_dir: str = Field("", description="where relative model paths resolve; set by load_config")

    @model_validator(mode="after")
    def _rules(self) -> "ClusterConfig":
        from ..engines.cost_model import PROFILES

        self._require("router.max_ongoing_requests", self.router.max_ongoing_requests >= self.replicas + 8)
        self._require("sampling.max_tokens", self.sampling.max_tokens < self.engine.max_model_len,
                      f" = {self.engine.max_model_len}")
        self._require("engine.max_num_batched_tokens",
                      self.engine.max_num_batched_tokens >= self.engine.max_num_seqs, f" = {self.engine.max_num_seqs}")
        self._require("engine.sim_profile", self.engine.sim_profile in PROFILES or Path(self.profile_path()).exists(),
                      f" (built-in: {', '.join(PROFILES)})")
        if self.base_dir:  # relative secret files and checkpoint roots resolve as the model path does
            sec, base = self.security, Path(self.base_dir)
            for name in ("token_file", "control_keys_file"):
                value = getattr(sec, name)
                if value and not Path(value).is_absolute():
                    setattr(sec, name, str(base / value))
            sec.checkpoint_roots = [r if Path(r).is_absolute() else str(base / r) for r in sec.checkpoint_roots]
        return self

    def validate(self) -> "ClusterConfig":
        """This config checked again after code changed it (assignment is not checked): a
        validated copy, or ConfigError."""
        return from_mapping(self.model_dump())

    def profile_path(self) -> str:
        """engine.sim_profile as load_profile should see it: a built-in name, or a file that
        resolves against base_dir like the model path."""
        name = self.engine.sim_profile
        p = Path(self.base_dir or ".") / name
        if not Path(name).is_absolute() and p.exists():
            return str(p.resolve())
        return name

    def model_path(self) -> str:
        """The model as vLLM should see it: a relative local path resolves against base_dir."""
        m = self.engine.model
        p = Path(self.base_dir or ".") / m
        if not Path(m).is_absolute() and p.exists():
            return str(p.resolve())
        return m


def from_mapping(data: dict) -> ClusterConfig:
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as e:
        raise config_error(e, ClusterConfig) from None
