"""Partial rollouts in the simulator: RL steps that cut their batch at `finish_fraction` and carry
the cut samples into the next step, against steps that wait for every sample.

Step k's batch is the samples carried from step k-1, each continuing after its tokens
(SequenceRequest.output_token_ids), plus a fresh rl-longtail batch drawn with seed k. The batch is
cut once `finish_fraction` of it is done (Simulation.run's cut_after, as generate's finish_fraction
does). Per step: its time, the samples completed, those of them that began in an earlier step
(part of their tokens came from older weights: the off-policy share), and the samples carried on.
Fraction 1.0 is the plain step that waits for its longest sample. Every step runs the same policy
(default steal) on the same profile; the fleet starts each step empty.

    python experiments/partial-rollouts/run.py --fractions 1.0,0.95,0.9,0.8 --steps 6 --out experiments/partial-rollouts/results
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from rollout_cluster.bench.workloads import LongtailSpec, rl_longtail
from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.sim.simulator import Simulation
from rollout_cluster.protocol import SequenceRequest


@dataclass
class Carried:
    request: SequenceRequest  # the sample as first asked (prompt, cap, hidden length)
    generated: int  # tokens it has so far
    born: int  # the step it started in


def step_batch(carried: list, fresh: list) -> list:
    """The carried samples (continuations, in front) and the fresh ones, as one batch."""
    out = []
    for i, c in enumerate(carried):
        r = c.request
        out.append(SequenceRequest(None, r.sampling, i, 0, r.hidden_length, prompt_len=r.prompt_len,
                                   output_token_ids=[0] * c.generated))
    base = len(carried)
    out += [replace(r, prompt_index=base + r.prompt_index) for r in fresh]
    return out


def run_steps(fraction: float, steps: int, spec: LongtailSpec, profile: str, replicas: int, policy: str,
              pull_interval_s: float = 0.5, progress: bool = False) -> list:
    cost = load_profile(profile)
    carried: list = []
    rows = []
    for k in range(steps):
        fresh = rl_longtail(replace(spec, seed=spec.seed + k))
        requests = step_batch(carried, fresh)
        born = [c.born for c in carried] + [k] * len(fresh)
        originals = [c.request for c in carried] + fresh
        sim = Simulation(make_policy(PolicyConfig(name=policy), cost), cost, replicas, pull_interval_s=pull_interval_s)
        cut_after = math.ceil(fraction * len(requests)) if fraction < 1.0 else 0
        res = sim.run(requests, cut_after=cut_after)
        completed = [i for i, c in enumerate(res.completions) if c.finish_reason != "abort"]
        cut = [i for i, c in enumerate(res.completions) if c.finish_reason == "abort"]
        assert all(res.completions[i].finish_reason == "length" for i in completed)
        assert all(res.generated[i] == r.hidden_length for i, r in zip(completed, (originals[i] for i in completed)))
        carried = [Carried(originals[i], res.generated[i], born[i]) for i in cut]
        resumed_tokens = sum(len(r.output_token_ids or ()) for r in requests)
        rows.append({
            "fraction": fraction, "step": k, "batch": len(requests), "step_s": round(res.makespan_s, 3),
            "cut_s": round(res.cut_s, 3), "completed": len(completed),
            "completed_from_earlier_steps": sum(1 for i in completed if born[i] < k),
            "carried_on": len(carried), "carried_tokens": sum(c.generated for c in carried),
            "tokens": sum(res.generated) - resumed_tokens, "migrations": res.counters["migrations"],
            "oldest_completed_age": max((k - born[i] for i in completed), default=0),
        })
        if progress:
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def summary(rows: list, warmup: int = 1) -> dict:
    """Per fraction, over the steps after `warmup` (the first step carries nothing in)."""
    out = {}
    for f in sorted({r["fraction"] for r in rows}, reverse=True):
        rs = [r for r in rows if r["fraction"] == f and r["step"] >= warmup] or [r for r in rows if r["fraction"] == f]
        time_s = sum(r["step_s"] for r in rs)
        done = sum(r["completed"] for r in rs)
        out[f] = {
            "steps": len(rs), "mean_step_s": round(time_s / len(rs), 2),
            "completed_per_step": round(done / len(rs), 1),
            "samples_per_s": round(done / time_s, 2), "tokens_per_s": round(sum(r["tokens"] for r in rs) / time_s, 1),
            "off_policy_pct": round(100.0 * sum(r["completed_from_earlier_steps"] for r in rs) / max(1, done), 2),
            "oldest_age": max(r["oldest_completed_age"] for r in rs),
            "carried_per_step": round(sum(r["carried_on"] for r in rs) / len(rs), 1),
        }
    return out


def markdown(summ: dict) -> str:
    base = summ.get(1.0)
    lines = ["| finish_fraction | mean step (s) | samples completed / step | samples / s | vs waiting for all "
             "| completed that began a step earlier | oldest (steps) | carried / step |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for f, s in summ.items():
        gain = f"{s['samples_per_s'] / base['samples_per_s']:.3f}x" if base else "-"
        lines.append(f"| {f:g} | {s['mean_step_s']:.2f} | {s['completed_per_step']:.0f} | {s['samples_per_s']:.2f} | {gain} "
                     f"| {s['off_policy_pct']:.2f} % | {s['oldest_age']} | {s['carried_per_step']:.0f} |")
    return "\n".join(lines)


def plot(rows: list, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for f in sorted({r["fraction"] for r in rows}, reverse=True):
        rs = [r for r in rows if r["fraction"] == f]
        ax[0].plot([r["step"] for r in rs], [r["step_s"] for r in rs], marker="o", label=f"finish_fraction {f:g}")
        ax[1].plot([r["step"] for r in rs], [r["completed"] for r in rs], marker="o", label=f"{f:g}")
    ax[0].set(xlabel="RL step", ylabel="step time (s)", title="Step time")
    ax[1].set(xlabel="RL step", ylabel="samples completed", title="Samples completed per step")
    ax[0].legend()
    ax[0].set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fractions", default="1.0,0.95,0.9,0.8")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--profile", default="a100-80g-7b")
    ap.add_argument("--replicas", type=int, default=32)
    ap.add_argument("--policy", default="steal")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="folder for steps.jsonl, summary.json, table.md and steps.png")
    args = ap.parse_args(argv)
    from tqdm import tqdm

    spec = LongtailSpec(prompts=args.prompts, samples=args.samples, seed=args.seed).validate()
    fractions = [float(x) for x in args.fractions.split(",")]
    rows = []
    for f in tqdm(fractions, desc="fractions", unit="fraction"):
        rows += run_steps(f, args.steps, spec, args.profile, args.replicas, args.policy)
    summ = summary(rows)
    table = markdown(summ)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / "summary.json").write_text(json.dumps({str(k): v for k, v in summ.items()}, indent=1))
        (out / "table.md").write_text(table + "\n")
        plot(rows, out / "steps.png")


if __name__ == "__main__":
    main()
