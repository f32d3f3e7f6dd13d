"""Where steal loses against the balance bound, at seed scale in the simulator (docs/benchmarks.md, section 1).

For each seed and spread chunk it runs `steal` twice: as shipped, and with an oracle that feeds the
policy every sequence's true remaining length (a diagnostic only: no real policy knows them). For
each run it prints the makespan against the balance bound, and when the median replica reached
its 1000th and 4000th decode step against the fluid schedule of the balance bound. The fluid
schedule prefills every group's prompt once for the whole fleet; a replica prefills the prompt of
every group it holds a sample of, which the early milestone shows.

    python experiments/balance-gap/run.py --profile a100-80g-7b --seeds 0,1 --spread-chunk 1,2
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from rollout_cluster.bench.bounds import balance_bound, fluid_schedule
from rollout_cluster.bench.workloads import LongtailSpec, rl_longtail
from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy.steal import Load, StealPolicy
from rollout_cluster.sim.engine import FastEngineCore
from rollout_cluster.sim.simulator import Simulation

MILESTONES = (1000, 4000)


class OracleSteal(StealPolicy):
    """steal with the true remaining length of every sequence in place of its estimate."""

    def _load(self, view, rep, typical, starts=(), running_only=False):
        load = super()._load(view, rep, typical, starts, running_only)  # the same rows and contexts
        true = np.array([min(s.request.hidden_length or s.max_tokens, s.max_tokens) - s.generated
                         for s in load.seqs], dtype=np.float64)
        return Load(np.maximum(1.0, true), load.ctx, load.seqs, self.cost)


class StepClockEngine(FastEngineCore):
    """Records (decode steps, seconds) of every advance, to time the step milestones."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.runs: list = []

    def advance(self, limit_s=float("inf"), max_steps=1 << 30):
        before = self.steps
        dt = super().advance(limit_s, max_steps)
        self.runs.append((self.steps - before, dt))
        return dt


def time_at_step(runs: list, step: int) -> float:
    """Busy seconds until the engine's `step`-th decode step (linear within an advance)."""
    done, t = 0, 0.0
    for k, dt in runs:
        if done + k >= step and k:
            return t + dt * (step - done) / k
        done, t = done + k, t + dt
    return float("nan")


def fluid_time_at_step(intervals: list, step: int) -> float:
    for iv in intervals:
        if iv.steps + iv.k >= step:
            return iv.t + iv.seconds * (step - iv.steps) / max(1, iv.k)
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="a100-80g-7b")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--spread-chunk", default="1,2")
    ap.add_argument("--variants", default="steal,oracle")
    a = ap.parse_args()
    cost = load_profile(a.profile, 256)
    for seed in (int(x) for x in a.seeds.split(",")):
        reqs = rl_longtail(LongtailSpec(seed=seed), vocab_size=32000)  # the seed scale
        balance = balance_bound(reqs, cost, 32)
        fluid = list(fluid_schedule(reqs, cost, 32))
        for chunk in (int(x) for x in a.spread_chunk.split(",")):
            for variant in a.variants.split(","):
                policy_cls = {"steal": StealPolicy, "oracle": OracleSteal}[variant]
                sim = Simulation(policy_cls(PolicyConfig(name="steal", spread_chunk=chunk), cost), cost, 32,
                                 trace=False, engine=StepClockEngine)
                res = sim.run(reqs)
                row = {"seed": seed, "profile": a.profile, "spread_chunk": chunk, "variant": variant,
                       "makespan_s": round(res.makespan_s, 2), "balance_bound_s": round(balance, 2),
                       "to_balance_bound": round(res.makespan_s / balance, 3),
                       "migrations": res.counters["migrations"]}
                for m in MILESTONES:
                    row[f"step{m}_median_replica_s"] = round(float(np.median(
                        [time_at_step(e.runs, m) for e in sim.engines.values()])), 2)
                    row[f"step{m}_fluid_s"] = round(fluid_time_at_step(fluid, m), 2)
                print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
