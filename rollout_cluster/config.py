"""Cluster configuration: the one place where defaults live.

YAML is loaded into these dataclasses by `load_config`, which refuses unknown keys, wrong
types and impossible values with a ConfigError that names the key path and the value.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml


class ConfigError(ValueError):
    pass


@dataclass
class EngineConfig:
    kind: str = "vllm"  # vllm | sim
    model: str = "models/tiny-llama"  # local path or HF id
    load_format: str = "auto"  # auto | dummy | safetensors | ...
    dtype: str = "auto"
    max_model_len: int = 4096
    max_num_seqs: int = 256  # set always: AsyncLLM's defaults are smaller than LLM's
    max_num_batched_tokens: int = 8192
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    # The CPU build has no CuMem allocator: there sleep() only pauses the engine.
    enable_sleep_mode: bool = False  # GPU: vLLM sleep mode, so RolloutClient.sleep frees the GPUs' memory for a trainer beside the engines
    seed: int = 0
    stream_interval: int = 8  # tokens between progress deltas: per-token streaming of hundreds of requests costs the engine's process
    # Ray starts workers at nice 15 (RAY_worker_niceness) so that raylet and GCS stay responsive;
    # an engine inheriting that loses its core to any nice-0 process.
    niceness: Optional[int] = 0  # the replica's engine thread and processes run at this niceness (null: keep Ray's 15)
    cpu_kv_cache_gib: int = 1  # VLLM_CPU_KVCACHE_SPACE in GiB (CPU build only)
    cpu_bind_cores: bool = True  # pin replica k to core k (VLLM_CPU_OMP_THREADS_BIND)
    sim_profile: str = "a100-80g-7b"  # kind=sim: built-in profile name or YAML file
    sim_vocab_size: int = 32000
    sim_time_scale: float = 1.0  # kind=sim: wall seconds per modelled second (>1: slower than modelled, less host CPU a second)


@dataclass
class ReplicaResources:
    num_cpus: float = 1.0
    num_gpus: float = 0.0


# A replica reports an urgent segment end (work queued for the slot, a give-up's partials) no
# sooner than this fraction of the report interval after its last report: it pulls at most twice
# an interval, and a fleet past router.max_pulls_per_s stays within twice that while work is queued.
URGENT_REPORT_GAP_FRAC = 0.5


@dataclass
class RouterConfig:
    pull_wait_s: float = 0.05  # long-poll of a replica that runs sequences: orders at once, else after this
    idle_pull_wait_s: float = 1.0  # long-poll of a replica that holds nothing: new work wakes it at once
    report_interval_s: float = 0.2  # a replica that runs sequences reports this often, and at once when one ends
    max_pulls_per_s: float = 160.0  # periodic reports and idle long-polls stay near this many a second: their interval grows with the fleet
    replica_timeout_s: float = 60.0  # no pull for this long: the replica is dead, requeue its work
    max_ongoing_requests: int = 4096  # >> replicas + drivers: pulls must never queue
    submit_wait_for_replica_s: float = 600.0  # a submit with no live replica fails after this
    # 0 makes decisions prompt where engines keep every core busy, at the price of engine time
    # (2-core CPU cluster, docs/benchmarks.md: steal's decision p99 43 -> 2.2 ms, no makespan gain).
    niceness: Optional[int] = None  # the router's threads run at this niceness (null: keep Ray's 15)
    call_timeout_s: float = 120.0  # bound on every driver -> router call
    abandoned_batch_s: float = 900.0  # a batch no driver fetched from for this long (its driver died) is cancelled and dropped; 0: never

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


@dataclass
class PolicyConfig:
    name: str = "steal"  # steal | pull | static | least-loaded | chunked | scripted
    chunk_tokens: int = 1024  # chunked: tokens per round
    min_move_interval_s: float = 2.0  # steal: no sequence moves twice within this
    max_moves_per_seq: int = 3  # steal: cap on moves of one sequence
    min_gain_s: float = 0.5  # steal: a move must shorten the victim's predicted finish by this...
    min_gain_frac: float = 0.06  # steal: ...and by this fraction of it (scale-free: CPU seconds, GPU minutes)
    max_moves_per_decision: int = 32
    max_reprefill_frac: float = 0.10  # steal: re-prefilled tokens stay below this fraction of generated tokens
    spread_groups: bool = True  # steal: place a group's samples on different replicas (their lengths correlate)
    spread_chunk: int = 2  # steal, spreading: a group's samples go to a replica this many at a time (fewer prompt prefills)
    tail_isolation: bool = False  # steal: estimate remaining work from group siblings (measured: docs/benchmarks.md)
    scripted_at_tokens: list = field(default_factory=list)  # scripted: migrate at these token counts


@dataclass
class SamplingDefaults:
    """Defaults for what a request leaves out: a JSONL line's missing fields (`rollout-cluster
    generate`, the Ray job, POST /<app>/generate), and `RolloutClient.generate` / `stream` called
    without `sampling`. A field the line or the SamplingSpec sets wins."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0

    def spec_fields(self) -> dict:
        """The SamplingSpec fields these set."""
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p}


@dataclass
class MetricsConfig:
    port: int = 0  # 0: no HTTP endpoint


@dataclass
class ClusterConfig:
    app_name: str = "rollout"
    replicas: int = 2
    engine: EngineConfig = field(default_factory=EngineConfig)
    resources: ReplicaResources = field(default_factory=ReplicaResources)
    router: RouterConfig = field(default_factory=RouterConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    base_dir: str = ""  # where relative model paths resolve; set by load_config

    def validate(self) -> "ClusterConfig":
        checks = [
            ("replicas", self.replicas >= 1, "must be >= 1"),
            ("engine.kind", self.engine.kind in ("vllm", "sim"), "must be 'vllm' or 'sim'"),
            ("engine.max_model_len", self.engine.max_model_len >= 2, "must be >= 2"),
            ("engine.max_num_seqs", self.engine.max_num_seqs >= 1, "must be >= 1"),
            ("engine.max_num_batched_tokens", self.engine.max_num_batched_tokens >= 1, "must be >= 1"),
            ("engine.stream_interval", self.engine.stream_interval >= 1, "must be >= 1"),
            ("engine.sim_time_scale", self.engine.sim_time_scale > 0, "must be > 0"),
            ("engine.niceness", self.engine.niceness is None or -20 <= self.engine.niceness <= 19,
             "must be null or in [-20, 19]"),
            ("router.niceness", self.router.niceness is None or -20 <= self.router.niceness <= 19,
             "must be null or in [-20, 19]"),
            ("policy.max_reprefill_frac", 0 <= self.policy.max_reprefill_frac <= 1, "must be in [0, 1]"),
            ("engine.tensor_parallel_size", self.engine.tensor_parallel_size >= 1, "must be >= 1"),
            ("engine.gpu_memory_utilization", 0 < self.engine.gpu_memory_utilization <= 1, "must be in (0, 1]"),
            ("engine.cpu_kv_cache_gib", self.engine.cpu_kv_cache_gib > 0, "must be > 0"),
            ("resources.num_cpus", self.resources.num_cpus >= 0, "must be >= 0"),
            ("resources.num_gpus", self.resources.num_gpus >= 0, "must be >= 0"),
            ("router.pull_wait_s", 0 < self.router.pull_wait_s <= 5, "must be in (0, 5]"),
            ("router.replica_timeout_s", self.router.replica_timeout_s > 0, "must be > 0"),
            ("router.idle_pull_wait_s", 0 < self.router.idle_pull_wait_s <= min(5.0, self.router.replica_timeout_s / 4),
             f"must be in (0, min(5, router.replica_timeout_s / 4 = {self.router.replica_timeout_s / 4:g})]"),
            ("router.report_interval_s", 0 < self.router.report_interval_s <= min(5.0, self.router.replica_timeout_s / 4),
             f"must be in (0, min(5, router.replica_timeout_s / 4 = {self.router.replica_timeout_s / 4:g})]"),
            ("router.max_pulls_per_s", self.router.max_pulls_per_s > 0, "must be > 0"),
            ("router.max_ongoing_requests", self.router.max_ongoing_requests >= self.replicas + 8,
             "must exceed replicas + drivers, or pulls queue behind each other"),
            ("router.call_timeout_s", self.router.call_timeout_s > 0, "must be > 0"),
            ("router.abandoned_batch_s", self.router.abandoned_batch_s == 0 or self.router.abandoned_batch_s >= 10,
             "must be 0 (never) or >= 10: drivers fetch about once a second"),
            ("policy.name", self.policy.name in POLICY_NAMES, f"must be one of {sorted(POLICY_NAMES)}"),
            ("policy.chunk_tokens", self.policy.chunk_tokens >= 1, "must be >= 1"),
            ("policy.spread_chunk", self.policy.spread_chunk >= 1, "must be >= 1"),
            ("policy.min_move_interval_s", self.policy.min_move_interval_s >= 0, "must be >= 0"),
            ("policy.min_gain_s", self.policy.min_gain_s >= 0, "must be >= 0"),
            ("policy.min_gain_frac", 0 <= self.policy.min_gain_frac < 1, "must be in [0, 1)"),
            ("router.submit_wait_for_replica_s", self.router.submit_wait_for_replica_s >= 0, "must be >= 0"),
            ("policy.max_moves_per_seq", self.policy.max_moves_per_seq >= 0, "must be >= 0"),
            ("policy.max_moves_per_decision", self.policy.max_moves_per_decision >= 1, "must be >= 1"),
            ("metrics.port", 0 <= self.metrics.port <= 65535, "must be in [0, 65535]"),
            ("sampling.max_tokens", self.sampling.max_tokens >= 1, "must be >= 1"),
            ("sampling.max_tokens", self.sampling.max_tokens < self.engine.max_model_len,
             f"must be below engine.max_model_len={self.engine.max_model_len}"),
            ("sampling.temperature", self.sampling.temperature >= 0, "must be >= 0"),
            ("sampling.top_p", 0 < self.sampling.top_p <= 1, "must be in (0, 1]"),
        ]
        for key, ok, why in checks:
            if not ok:
                raise ConfigError(f"{key}={_get(self, key)!r}: {why}")
        from .engines.cost_model import PROFILES

        if self.engine.sim_profile not in PROFILES and not Path(self.profile_path()).exists():
            raise ConfigError(f"engine.sim_profile={self.engine.sim_profile!r}: neither a built-in profile "
                              f"({', '.join(PROFILES)}) nor an existing file (make one with `rollout-cluster calibrate`)")
        return self

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


POLICY_NAMES = {"steal", "pull", "static", "least-loaded", "chunked", "scripted"}


def _get(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _coerce(tp, value, key: str):
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key}={value!r}: must be a mapping")
        return from_dict(tp, value, key + ".")
    if origin is typing.Union:  # Optional[X]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return None if value is None else _coerce(args[0], value, key)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if origin is list or tp is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}={value!r}: must be a list")
        return value
    if tp in (int, float, str, bool):
        if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
            raise ConfigError(f"{key}={value!r}: must be of type {tp.__name__}")
        return value
    return value


def from_dict(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            raise ConfigError(f"{prefix}{k}: unknown key (known: {', '.join(sorted(names))})")
    kwargs = {k: _coerce(hints[k], v, prefix + k) for k, v in data.items()}
    return cls(**kwargs)


def load_config(source) -> ClusterConfig:
    """Load a ClusterConfig from a YAML path, a YAML string's dict, or pass one through."""
    if isinstance(source, ClusterConfig):
        return source.validate()
    base = ""
    if isinstance(source, (str, Path)):
        path = Path(source)
        if not path.exists():
            raise ConfigError(f"config file {str(path)!r} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from e
        # A file in `configs/` or one folder below it (configs/experiments/) resolves paths
        # against the project root above it; any other file against its own folder.
        here = path.resolve().parent
        root = next((d.parent for d in (here, here.parent) if d.name == "configs"), None)
        base = str(root or here)
    else:
        data = dict(source)
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a mapping, got {type(data).__name__}")
    cfg = from_dict(ClusterConfig, data)
    if not cfg.base_dir:
        cfg.base_dir = base
    return cfg.validate()


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
