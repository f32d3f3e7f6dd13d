"""Seed-scale simulator runs of two protocol choices (docs/benchmarks.md, sections 1 and 5):

- `--ends`: replicas report an ended segment at once always (the simulator's default), or only
  when work is queued or the end is a give-up's abort (`when-queued`), and then not before half
  the interval since the last report (`paced`: what replicas do, config.URGENT_REPORT_GAP_FRAC).
- `--migration-overhead`: what steal prices a migration's latency at (MIGRATION_OVERHEAD_S).
- `--spread-chunk`: how many samples of a group steal places on a replica at a time
  (`policy.spread_chunk`; 1 spreads the most, and pays the shared prompt's prefill the most).
- `--min-gain-frac`: the fraction of the victim's predicted finish a steal must save
  (`policy.min_gain_frac`).
- `--max-reprefill-frac`: steal's budget of re-prefilled tokens, a fraction of the tokens
  generated so far (`policy.max_reprefill_frac`).
- `--repay-factor`: how many times over a sequence's expected decode time left must repay its
  re-prefill for it to move (steal.REPAY_FACTOR).
- `--set KEY=V1,V2`: any other `policy.KEY` (repeatable), e.g. `--set max_moves_per_seq=3,5`.

    python experiments/steal-sensitivity/run.py --profile h200-1.5b --ends always,when-queued --pull-interval 0.5
    python experiments/steal-sensitivity/run.py --profile a100-80g-7b --migration-overhead 0.1,0.5,1.0
    python experiments/steal-sensitivity/run.py --profile a100-80g-7b --policies steal --spread-chunk 1,2,4 --seeds 0,1,2,3,4,5
    python experiments/steal-sensitivity/run.py --policies steal --min-gain-frac 0.02,0.04,0.06,0.09,0.12 --seeds 0,1,2,3,4,5
    python experiments/steal-sensitivity/run.py --policies steal --max-reprefill-frac 0.05,0.1,1.0 --repay-factor 5,20 --seeds 0,1,2,3,4,5

Prints one JSON line per run: seed, profile, pull interval, ends, overhead, spread chunk, min gain
fraction, re-prefill budget, repay factor, policy, makespan, its ratio to the balance bound,
migrations, re-prefilled % of generated tokens.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json

from rollout_cluster.bench.bounds import balance_bound
from rollout_cluster.bench.workloads import LongtailSpec, rl_longtail
from rollout_cluster.config import URGENT_REPORT_GAP_FRAC, PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.policy import steal
from rollout_cluster.sim.paced import PacedSimulation
from rollout_cluster.sim.simulator import Simulation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="a100-80g-7b")
    ap.add_argument("--pull-interval", type=float, default=0.5)
    ap.add_argument("--ends", default="always", help="always,when-queued,paced")
    ap.add_argument("--migration-overhead", default=str(steal.MIGRATION_OVERHEAD_S))
    ap.add_argument("--policies", default="least-loaded,steal")
    ap.add_argument("--spread-chunk", default=str(steal.StealConfig().spread_chunk))
    ap.add_argument("--min-gain-frac", default=str(steal.StealConfig().min_gain_frac))
    ap.add_argument("--max-reprefill-frac", default=str(steal.StealConfig().max_reprefill_frac))
    ap.add_argument("--repay-factor", default=str(steal.REPAY_FACTOR))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=V1,V2",
                    help="sweep another steal setting KEY over these values (repeatable)")
    ap.add_argument("--seeds", default="0")
    a = ap.parse_args()
    fields = steal.StealConfig.model_fields
    extra = []  # [(key, [values])]
    for item in a.set:
        key, _, values = item.partition("=")
        if key not in fields or not values:
            raise SystemExit(f"--set {item!r}: expected KEY=V1,V2 with KEY one of {sorted(fields)}")
        kind = type(getattr(steal.StealConfig(), key))
        parse = (lambda v: v.lower() in ("1", "true", "yes")) if kind is bool else kind
        extra.append((key, [parse(v) for v in values.split(",")]))
    cost = load_profile(a.profile, 256)
    sims = {"always": Simulation, "when-queued": PacedSimulation,
            "paced": functools.partial(PacedSimulation, urgent_gap_frac=URGENT_REPORT_GAP_FRAC)}
    for ends in a.ends.split(","):
        if ends not in sims:
            raise SystemExit(f"--ends={ends!r}: must be one of {sorted(sims)}")
    runs = itertools.product([int(x) for x in a.seeds.split(",")], a.ends.split(","),
                             [float(x) for x in a.migration_overhead.split(",")],
                             [int(x) for x in a.spread_chunk.split(",")],
                             [float(x) for x in a.min_gain_frac.split(",")],
                             [float(x) for x in a.max_reprefill_frac.split(",")],
                             [float(x) for x in a.repay_factor.split(",")], a.policies.split(","),
                             itertools.product(*[vals for _, vals in extra]))
    batch = {}  # seed -> (requests, balance bound): the current seed's only (seeds come first in `runs`)
    for seed, ends, overhead, chunk, gain, budget, repay, policy, picked in runs:
        more = {key: v for (key, _), v in zip(extra, picked)}
        if seed not in batch:
            reqs = rl_longtail(LongtailSpec(seed=seed), vocab_size=32000)  # the seed scale
            batch = {seed: (reqs, balance_bound(reqs, cost, 32))}
        reqs, balance = batch[seed]
        steal.MIGRATION_OVERHEAD_S, steal.REPAY_FACTOR = overhead, repay
        tuned = dict(spread_chunk=chunk, min_gain_frac=gain, max_reprefill_frac=budget, **more)
        pc = PolicyConfig(name=policy, **(tuned if policy == "steal" else {}))  # the sweep tunes steal
        res = sims[ends](make_policy(pc, cost), cost, 32, pull_interval_s=a.pull_interval, trace=False).run(reqs)
        print(json.dumps({"seed": seed, "profile": a.profile, "pull_interval_s": a.pull_interval,
                          "ends": ends, "migration_overhead_s": overhead, "spread_chunk": chunk,
                          "min_gain_frac": gain, "max_reprefill_frac": budget, "repay_factor": repay,
                          **more, "policy": policy, "makespan_s": round(res.makespan_s, 2),
                          "to_balance_bound": round(res.makespan_s / balance, 3),
                          "migrations": res.counters["migrations"],
                          "reprefill_pct": round(100 * res.counters["reprefill_tokens"]
                                                 / max(1, res.counters["generated_tokens"]), 2)}), flush=True)

if __name__ == "__main__":
    main()
