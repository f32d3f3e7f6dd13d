"""Pulls a paced fleet sends the router while work is queued, and what pacing costs the makespan.

A replica reports every `report_interval_for(replicas)` seconds (0.2 s up to 32 replicas, 1.6 s
at 256), and earlier when a segment ends while work is queued for its slot. With more sequences
than slots (vLLM's AsyncLLM default of 128 sequences an engine), segments end hundreds of times a
second in a large fleet. Each variant runs the same batch in the simulator:

- `ideal`: every ended segment reported at once (the simulator's default; no pull budget);
- `gap0`: urgent ends reported at once (the pacing before config.URGENT_REPORT_GAP_FRAC);
- `paced`: urgent ends no sooner than URGENT_REPORT_GAP_FRAC of the interval after the last report.

    python experiments/pull-budget/run.py --replicas 32,256 --max-num-seqs 128 --out experiments/pull-budget/results

Prints one JSON line per run: makespan, pulls a second (mean over the batch, and the busiest
1-second window after the first interval), the router's budget (router.max_pulls_per_s) and
migrations; writes them to OUT/pull-budget.jsonl.
"""
from __future__ import annotations

import argparse
import collections
import functools
import json
import time
from pathlib import Path

from rollout_cluster.bench.workloads import LongtailSpec, rl_longtail
from rollout_cluster.config import URGENT_REPORT_GAP_FRAC, PolicyConfig, RouterConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.sim.paced import PacedSimulation
from rollout_cluster.sim.simulator import Simulation

VARIANTS = {"ideal": Simulation, "gap0": PacedSimulation,
            "paced": functools.partial(PacedSimulation, urgent_gap_frac=URGENT_REPORT_GAP_FRAC)}


def pull_rates(pull_times: list, makespan_s: float, skip_s: float) -> tuple:
    """(mean pulls a second over the batch, most pulls in a 1-second window starting after skip_s)."""
    per_s = collections.Counter(int(t) for t in pull_times if t >= skip_s)
    return len(pull_times) / max(makespan_s, 1e-9), max(per_s.values(), default=0)


def run(variant: str, replicas: int, spec: LongtailSpec, max_num_seqs: int, policy: str = "steal",
        profile: str = "a100-80g-7b", router: RouterConfig = RouterConfig()) -> dict:
    cost = load_profile(profile, max_num_seqs)
    interval = router.report_interval_for(replicas)
    t0 = time.perf_counter()
    sim = VARIANTS[variant](make_policy(PolicyConfig(name=policy), cost), cost, replicas,
                            pull_interval_s=interval, trace=False)
    res = sim.run(rl_longtail(spec, vocab_size=32000))
    mean, peak = pull_rates(sim.pull_times, res.makespan_s, skip_s=interval)
    return {"variant": variant, "replicas": replicas, "max_num_seqs": max_num_seqs, "policy": policy,
            "profile": profile, "seed": spec.seed, "sequences": spec.prompts * spec.samples,
            "interval_s": interval, "makespan_s": round(res.makespan_s, 2),
            "pulls_per_s": round(mean, 1), "peak_pulls_in_1s": peak,
            "budget_per_s": router.max_pulls_per_s, "migrations": res.counters["migrations"],
            "wall_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", default="32,256")
    ap.add_argument("--prompts-per-replica", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--variants", default="ideal,gap0,paced")
    ap.add_argument("--policy", default="steal")
    ap.add_argument("--profile", default="a100-80g-7b")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    for v in a.variants.split(","):
        if v not in VARIANTS:
            raise SystemExit(f"--variants: {v!r} is not one of {sorted(VARIANTS)}")
    out = None
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        out = open(Path(a.out) / "pull-budget.jsonl", "a")
    for seed in [int(s) for s in a.seeds.split(",")]:
        for n in [int(r) for r in a.replicas.split(",")]:
            spec = LongtailSpec(prompts=a.prompts_per_replica * n, seed=seed)
            for v in a.variants.split(","):
                line = json.dumps(run(v, n, spec, a.max_num_seqs, a.policy, a.profile))
                print(line, flush=True)
                if out:
                    out.write(line + "\n")
                    out.flush()


if __name__ == "__main__":
    main()
