"""`rollout-cluster bench` and `simulate`: every policy on one workload, side by side.

One run = one workload (per seed), the bounds of that workload in a cost model, and for each
policy the metrics of BENCHMARK.md. The simulator engine runs here; the vLLM engine lives in
bench/vllm_run.py, which imports this module; bench/main.py picks one of the two, and imports the
vLLM one only when asked for, so `--engine sim` never loads ray or vllm.
"""
from __future__ import annotations

import json
import math
from typing import Optional

from ..config import PolicyConfig, load_config
from ..engines.cost_model import CostModel, load_profile
from ..policy.base import PolicySettings
from ..policy.registry import BENCH_POLICIES
from .bounds import bounds
from .flags import FlagError
from .workloads import LongtailSpec, load_trace, rl_longtail, summary

POLICIES = BENCH_POLICIES  # static, chunked, least-loaded, pull, steal
METRICS = ("makespan_s", "ratio_to_lower_bound", "tokens_per_s", "tail_s", "utilization", "migrations",
           "reprefill_pct", "decision_ms_mean", "decision_ms_p99")
# Re-prefill tokens actually prefilled (cache hits subtracted), % of generated: the simulator's
# engines count it; vLLM replicas report num_cached_tokens. `reprefill_pct` counts every
# continuation's prompt as sent.
PREFILLED = "reprefill_prefilled_pct"
SIM_SCALE = dict(prompts=512, samples=16, median=1500.0, sigma_prompt=0.9, sigma_sample=0.5, max_tokens=16384,
                 prompt_min=256, prompt_max=1024, replicas=None)  # replicas: the config's, else 32
SIM_REPLICAS = 32
CPU_SCALE = dict(prompts=16, samples=4, median=200.0, sigma_prompt=1.0, sigma_sample=0.4, max_tokens=2048,
                 prompt_min=16, prompt_max=64, replicas=None)  # replicas: the config's


# ---- inputs ---------------------------------------------------------------------------------
def fill_defaults(args) -> None:
    """Unset workload flags take the engine's scale from BENCHMARK.md (seed scale for sim,
    CPU scale for vllm)."""
    scale = SIM_SCALE if args.engine == "sim" else CPU_SCALE
    for key, value in scale.items():
        if args.trace and key != "replicas":
            continue  # a trace brings its own lengths; --max-tokens then defaults to its longest
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def workload(args, seed: int, vocab_size: Optional[int] = None, ids_salt: str = "") -> tuple:
    """(requests, description) for one seed: the trace file if given, else rl-longtail.
    Lengths depend on the seed only; `ids_salt` changes the token ids (vLLM: a fresh prefix cache)."""
    if args.trace:
        reqs = load_trace(args.trace, args.max_tokens, vocab_size, seed, ids_salt)
        return reqs, {"workload": "trace", "trace": str(args.trace), **summary(reqs)}
    spec = LongtailSpec(args.prompts, args.samples, args.median, args.sigma_prompt, args.sigma_sample,
                        args.max_tokens, seed, args.prompt_min, args.prompt_max)
    reqs = rl_longtail(spec, vocab_size, ids_salt)
    return reqs, {**spec.describe(), **summary(reqs)}


def policy_config(base: Optional[PolicySettings], name: str) -> PolicySettings:
    """The config's policy settings when the config names this policy, else its defaults."""
    return base if base is not None and base.name == name else PolicyConfig(name=name)


def cluster_config(args):
    """The --config file (None for a plain sim run), its replicas replaced by --replicas."""
    if not args.config:
        return None
    cfg = load_config(args.config)
    if args.replicas:
        cfg = cfg.model_copy(update={"replicas": args.replicas})
        cfg.router.max_ongoing_requests = max(cfg.router.max_ongoing_requests, cfg.replicas + 8)
    return cfg.validate()


def sim_setup(args) -> tuple:
    """(config or None, cost model) for a simulator run; --replicas defaults to the config's, else 32."""
    pull, slow = getattr(args, "pull_interval", 0.5), getattr(args, "host_slowdown", 0.0)
    if not 0 < pull < float("inf"):  # (0 never advances the simulator's clock: it would spin)
        raise FlagError(f"--pull-interval={pull!r}: must be > 0 seconds of virtual time")
    if not 0 <= slow < float("inf"):
        raise FlagError(f"--host-slowdown={slow!r}: must be >= 0")
    cfg = cluster_config(args)
    if args.replicas is None:
        args.replicas = cfg.replicas if cfg else SIM_REPLICAS
    return cfg, cost_model(args, cfg)


def cost_model(args, cfg) -> CostModel:
    """--profile (default: the config's sim_profile, else a100-80g-7b) with the engine's max_num_seqs."""
    name = args.profile or (cfg.profile_path() if cfg else "a100-80g-7b")
    try:
        return load_profile(name, cfg.engine.max_num_seqs if cfg else None)
    except ValueError as e:  # (no such built-in profile or file, or a file that is no profile)
        raise FlagError(f"--profile: {e}" if args.profile else str(e)) from None


# ---- metrics --------------------------------------------------------------------------------
def tail_s(finish_times: list) -> float:
    """Seconds from 90 % of sequences done to 100 % done."""
    if not finish_times:
        return 0.0
    ft = sorted(finish_times)
    return ft[-1] - ft[max(0, math.ceil(0.9 * len(ft)) - 1)]


def percentile(values: list, q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]); 0 for no values."""
    if not values:
        return 0.0
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


def policy_metrics(makespan: float, finish_times: list, generated: int, utilization: float, migrations: int,
                   reprefill_tokens: int, decision_ms: tuple, lower: float) -> dict:
    """One row of results, in the key order of BENCHMARK.md."""
    return {
        "makespan_s": round(makespan, 4),
        "ratio_to_lower_bound": round(makespan / lower, 4) if lower > 0 else None,
        "tokens_per_s": round(generated / makespan, 2) if makespan > 0 else 0.0,
        "tail_s": round(tail_s(finish_times), 4),
        "utilization": round(utilization, 4),
        "migrations": int(migrations),
        "reprefill_pct": round(100.0 * reprefill_tokens / generated, 3) if generated else 0.0,
        "decision_ms_mean": round(decision_ms[0], 4),
        "decision_ms_p99": round(decision_ms[1], 4),
    }


def decision_stats_ms(times_s: list) -> tuple:
    return (1e3 * sum(times_s) / len(times_s) if times_s else 0.0, 1e3 * percentile(times_s, 0.99))


# ---- the simulator engine -------------------------------------------------------------------
def simulate_policy(name: str, requests: list, cost: CostModel, replicas: int, lower: float,
                    base: Optional[PolicySettings] = None, pull_interval_s: float = 0.5,
                    host_slowdown: float = 0.0) -> tuple:
    """(metrics row, trace {replica: [(t, active)]}) of one policy on the simulator."""
    from ..policy import make_policy
    from ..sim.simulator import Simulation

    sim = Simulation(make_policy(policy_config(base, name), cost), cost, replicas, pull_interval_s=pull_interval_s,
                     host_slowdown=host_slowdown)
    res = sim.run(requests)
    bad = [c for c in res.completions if c is None or c.finish_reason == "error"]
    if bad:
        raise RuntimeError(f"policy {name}: {len(bad)} sequences did not complete")
    span = res.makespan_s
    util = sum(res.busy_s.values()) / (replicas * span) if span > 0 else 0.0
    c = res.counters
    row = policy_metrics(span, res.finish_times, c["generated_tokens"], min(1.0, util), c["migrations"],
                         res.reprefill_tokens, decision_stats_ms(res.decision_times_s), lower)
    generated = c["generated_tokens"]
    row[PREFILLED] = round(100.0 * res.reprefilled_tokens / generated, 3) if generated else 0.0
    return row, res.trace


def header(engine: str, replicas: int, desc: dict, b: dict, cost: CostModel, note: str) -> dict:
    """The top-level keys of bench.json (BENCHMARK.md), then provenance."""
    return {"engine": engine, "replicas": replicas, "sequences": desc["sequences"],
            "generated_tokens": desc["generated_tokens"], "lower_bound_s": round(b["lower_bound_s"], 4),
            "balance_bound_s": round(b["balance_bound_s"], 4), "results": {},
            "bound_terms": {"longest_alone_s": round(b["longest_alone_s"], 4),
                            "work_per_replica_s": round(b["work_s"] / replicas, 4)},
            "profile": cost.name, "bound_note": note, "workload": desc}


def run_seed_sim(args, seed: int, cost: CostModel, cfg, policies: list, bar=None) -> tuple:
    """One seed on the simulator: (bench dict, traces {policy: trace})."""
    requests, desc = workload(args, seed)
    b = bounds(requests, cost, args.replicas)
    out = header("sim", args.replicas, desc, b, cost, f"bounds and engine both from the cost model {cost.name}")
    traces = {}
    for name in policies:
        if bar is not None:
            bar.set_postfix_str(f"seed {seed} {name}")
        out["results"][name], traces[name] = simulate_policy(
            name, requests, cost, args.replicas, b["lower_bound_s"], cfg.policy if cfg else None,
            args.pull_interval, args.host_slowdown)
        if bar is not None:
            bar.update(1)
    return out, traces


def combine(runs: list, seeds: list) -> dict:
    """One seed: its dict. Several: the mean of every figure at the top, the runs in `per_seed`."""
    if len(runs) == 1:
        return {**runs[0], "seed": seeds[0]}
    first = runs[0]
    mean = lambda key, rows: round(sum(r[key] for r in rows) / len(rows), 4)  # noqa: E731
    out = {k: first[k] for k in ("engine", "replicas", "replica_engine") if k in first}
    for key in ("sequences", "generated_tokens", "lower_bound_s", "balance_bound_s"):
        out[key] = mean(key, runs)
    out["results"] = {}
    for name in first["results"]:
        rows = [r["results"][name] for r in runs]
        out["results"][name] = {k: mean(k, rows) for k in METRICS}
        if all(row.get(PREFILLED) is not None for row in rows):
            out["results"][name][PREFILLED] = mean(PREFILLED, rows)
        ratios = [row["ratio_to_lower_bound"] for row in rows]
        out["results"][name]["ratio_to_lower_bound_range"] = [min(ratios), max(ratios)]
    out.update(profile=first["profile"], bound_note=first["bound_note"], seeds=seeds,
               summary="mean over seeds", per_seed=[{**r, "seed": s} for r, s in zip(runs, seeds)])
    if all(r.get("repeats") for r in runs):
        from .repeats import across_seeds

        out["repeats"] = across_seeds([r["repeats"] for r in runs])
    return out


def simulate(args) -> dict:
    """One policy on the simulator; the bench.json form on stdout."""
    args.engine = "sim"
    fill_defaults(args)
    cfg, cost = sim_setup(args)
    run, _ = run_seed_sim(args, args.seed, cost, cfg, [args.policy])
    run["seed"] = args.seed
    print(json.dumps(run, indent=1))
    return run


def parse_policies(text: Optional[str]) -> list:
    if text is None:
        return list(POLICIES)
    names = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICIES]
    if unknown or not names:
        raise FlagError(f"--policies={text!r}: unknown {','.join(unknown) or 'none given'}; "
                        f"choose from {','.join(POLICIES)}")
    twice = sorted({p for p in names if names.count(p) > 1})
    if twice:
        raise FlagError(f"--policies={text!r}: {','.join(twice)} listed more than once (each policy runs once a seed; "
                        "--repeats runs rounds)")
    return names
