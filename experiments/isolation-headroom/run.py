"""How far tail isolation could go on the seed scale, with an oracle (docs/benchmarks.md, issue 4).

Two numbers bracket what any placement can reach when it knows the true lengths, which no
shipped policy does:

1. `informed`: the fluid schedule of bounds.balance_bound (bounds.fluid_schedule) until the
   longest sequence has g tokens, then that sequence alone on a replica (perfect isolation, free
   migration). It is the makespan floor for a policy that learns who is longest only after g tokens.
2. `identification`: how well the group-sibling estimate (policy/estimate.py) finds the long
   sequences as the batch runs: of the K running sequences it ranks longest, how many are truly
   among the longest (>= LONG tokens). Sampled from a steal run with `tail_isolation` on.
3. `oracle`: a real simulation (same RouterCore, same engines) of a two-class placement: the K
   truly longest sequences spread over T tail replicas that also take bulk work up to a batch of
   `cap`, the rest pulled by the other replicas. A crude oracle, but it shows what isolation buys.

Usage: python experiments/isolation-headroom/run.py [--profile a100-80g-7b] [--seed 0] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rollout_cluster.bench.bounds import (bounds, decode_alone_s, first_of_group, fluid_schedule,
                                          fluid_steps_s, request_shapes, work_s)
from rollout_cluster.bench.workloads import LongtailSpec, rl_longtail
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy.base import Assign, Decision, Policy
from rollout_cluster.sim.simulator import Simulation

LONG = 8000
TOP_K = 384
SAMPLE_EVERY_S = 10.0
PLACEMENTS = [(82, 8, 0), (82, 8, 32), (164, 16, 32), (328, 16, 32), (360, 20, 32), (500, 20, 40)]
INFORMED_AT = [250, 500, 1000, 2000, 3000, 4000]


class OracleIsolation(Policy):
    """Test-only: reads the true lengths (`hidden_length`), which the shipped policies never do."""

    name = "oracle-isolation"

    def __init__(self, requests: list, longest: int, tail_replicas: int, cap: int):
        order = sorted(range(len(requests)), key=lambda i: -requests[i].hidden_length)
        self.tail = {i: j % tail_replicas for j, i in enumerate(order[:longest])}
        self.tail_replicas, self.cap = tail_replicas, cap

    def decide(self, view, replica_id: str) -> Decision:
        idx, fresh = int(replica_id[1:]), view.queue.fresh.values()
        rep = view.replicas[replica_id]
        if idx < self.tail_replicas:
            out = [s for s in fresh if self.tail.get(s.index) == idx]
            room = self.cap - rep.load - len(out)
        else:
            out, room = [], rep.free_slots
        for s in fresh:
            if room <= 0:
                break
            if s.index not in self.tail:
                out.append(s)
                room -= 1
        return Decision(assign=[Assign(s, replica_id) for s in out])


def identification(requests: list, cost, replicas: int) -> list:
    """[(t, running, truly long running, of the top-K by estimate truly long)] every SAMPLE_EVERY_S."""
    import numpy as np

    from rollout_cluster.config import PolicyConfig
    from rollout_cluster.policy.estimate import TYPICAL_LENGTH_FLOOR, expected_remaining_array
    from rollout_cluster.policy.steal import StealPolicy
    from rollout_cluster.router.state import SeqStatus

    policy = StealPolicy(PolicyConfig(name="steal", tail_isolation=True), cost)
    rows, decide = [], policy.decide

    def sampled(view, replica_id):
        if not rows or view.now - rows[-1][0] >= SAMPLE_EVERY_S:
            seqs = [s for r in view.replicas.values() for s in r.seqs.values() if s.status is SeqStatus.RUNNING]
            groups = [view.groups.get(s.group) for s in seqs]
            window = view.finished_lengths[-512:]  # as the policy's typical length, without touching its state
            typical = max(float(TYPICAL_LENGTH_FLOOR), float(np.median(window)) if len(window) >= 8 else 0.0)
            rem = expected_remaining_array(np.array([s.generated for s in seqs], dtype=float),
                                           np.array([s.max_tokens for s in seqs], dtype=float),
                                           np.array([g.size if g else 1 for g in groups], dtype=float),
                                           np.array([g.finished if g else 0 for g in groups], dtype=float),
                                           typical)
            long = np.array([s.request.hidden_length >= LONG for s in seqs])
            top = np.argsort(-rem, kind="stable")[:TOP_K]
            rows.append((round(view.now, 1), len(seqs), int(long.sum()), int(long[top].sum())))
        return decide(view, replica_id)

    policy.decide = sampled
    Simulation(policy, cost, replicas, trace=False).run(requests)
    return rows


def informed_bound(requests: list, cost, replicas: int, marks: list) -> dict:
    """{g: fluid time until the longest sequence has g tokens + that sequence alone for the rest,
    and never less than the work bound}. g counts from the longest sequence's own start (it may be
    admitted late when the batch exceeds the fleet's slots)."""
    shape, first = request_shapes(requests), first_of_group(requests)
    longest = max(range(len(shape)), key=lambda i: shape[i][1])
    prompt, length = shape[longest]
    reach, start = {}, None
    for iv in fluid_schedule(requests, cost, replicas):
        if longest in iv.admitted:
            start = iv.steps
        for g in marks:
            if start is not None and iv.steps < start + g <= iv.steps + iv.k:
                reach[g] = iv.t + fluid_steps_s(cost, replicas, iv.active, iv.context, start + g - iv.steps)
    work = sum(work_s(cost, p, n, not f) for (p, n), f in zip(shape, first)) / replicas
    return {g: max(work, reach[g] + decode_alone_s(cost, prompt + g, length - g)) for g in marks if g in reach}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="a100-80g-7b")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replicas", type=int, default=32)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cost = load_profile(args.profile)
    requests = rl_longtail(LongtailSpec(seed=args.seed))
    b = bounds(requests, cost, args.replicas)
    lb = b["lower_bound_s"]
    out = {"profile": args.profile, "seed": args.seed, "lower_bound_s": round(lb, 2),
           "balance_bound_s": round(b["balance_bound_s"], 2), "informed": {}, "identification": [], "oracle": []}
    print(f"lower bound {lb:.1f} s, balance bound {b['balance_bound_s']:.1f} s")
    for g, t in informed_bound(requests, cost, args.replicas, INFORMED_AT).items():
        out["informed"][g] = round(t, 2)
        print(f"informed after {g:5d} tokens: {t:6.1f} s ({t / lb:.3f}x)")
    for t, running, long, found in identification(requests, cost, args.replicas):
        out["identification"].append({"t_s": t, "running": running, "long_running": long, f"long_in_top_{TOP_K}": found})
        if t <= 160:
            print(f"t={t:6.1f} s: {running:5d} running, {long:4d} of them >= {LONG} tokens; "
                  f"the estimate's top {TOP_K} holds {found}")
    for k, tails, cap in PLACEMENTS:
        t0 = time.time()
        res = Simulation(OracleIsolation(requests, k, tails, cap), cost, args.replicas, trace=False).run(requests)
        row = {"longest": k, "tail_replicas": tails, "cap": cap, "makespan_s": round(res.makespan_s, 2),
               "ratio_to_lower_bound": round(res.makespan_s / lb, 3)}
        out["oracle"].append(row)
        print(f"oracle: {k} longest on {tails} replicas (batch cap {cap}): {res.makespan_s:6.1f} s "
              f"({res.makespan_s / lb:.3f}x) [{time.time() - t0:.0f} s wall]", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "headroom.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
