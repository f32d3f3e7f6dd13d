"""What a per-prompt length history would buy steal, at seed scale in the simulator (docs/benchmarks.md, section 1).

RL prompts recur across epochs, so a trainer could tell the router how long each prompt's answers
ran last time. This script measures what that knowledge is worth before building an API for it.
Every prompt gets a hint: the geometric mean of `--history` fresh samples of its true difficulty,
drifted by lognormal(0, `--drift`) (the policy changed since). `--history 0 --drift 0` hands the
policy each prompt's exact difficulty: a perfect per-prompt predictor. Nothing tells it how a
sample differs from its prompt's median (σs = 0.5 on rl-longtail): that is decided by sampling.

Variants (each against the same batch):
- `steal`: as shipped (remaining work from progress and the recent typical length).
- `hint`: steal whose remaining-work estimate is the lognormal tail beyond the sequence's
  progress, with the prompt's hint as median and GROUP_SIGMA as spread.
- `hint-two-class`: `hint`, and the samples of the `--tail-groups` prompts with the longest hints
  placed at t=0 alone on `--tail-replicas` replicas (isolation from the start), the rest of
  the batch on the other replicas.

Also prints, per seed: how many sequences run to the cap and from how many prompts, how well
the hints correlate with the log lengths, the additive cost model's account of the balance bound: with at least R
sequences at the longest length, every replica of the fluid schedule runs that many steps,
so the bound is close to a * L_max + (the batch's own decode costs) / R; and the makespan, in that
model, of a greedy placement that knows every length (`greedy_placement`).

    python experiments/length-hints/run.py --seeds 0,1,2,3,4,5 --variants steal,hint
    python experiments/length-hints/run.py --seeds 0,1,2 --variants hint-two-class --tail-groups 8 --tail-replicas 6
    python experiments/length-hints/run.py --seeds 0,1,2,3,4,5 --variants ""   # the per-seed lines only
"""
from __future__ import annotations

import argparse
import json
import math
import random

import numpy as np

from rollout_cluster.bench.bounds import balance_bound, bounds
from rollout_cluster.bench.workloads import LongtailSpec, prompt_difficulties, rl_longtail
from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import CostModel, load_profile
from rollout_cluster.policy.base import Assign, Decision
from rollout_cluster.policy.estimate import GROUP_SIGMA, lognormal_remaining, own_costs
from rollout_cluster.policy.steal import Load, StealPolicy
from rollout_cluster.sim.simulator import Simulation


def prompt_hints(spec: LongtailSpec, history: int, drift: float, seed: int = 0) -> list:
    """Per prompt: the geometric mean of `history` lengths drawn (clipped as rl-longtail clips
    them) around its difficulty drifted by lognormal(0, drift); the drifted difficulty itself
    when `history` is 0."""
    rng = random.Random(f"length-hints-{spec.seed}-{seed}")
    out = []
    for d in prompt_difficulties(spec):
        mu = math.log(d) + rng.gauss(0.0, drift)
        if history <= 0:
            out.append(math.exp(mu))
            continue
        logs = [math.log(min(spec.max_tokens, max(16.0, rng.lognormvariate(mu, spec.sigma_sample))))
                for _ in range(history)]
        out.append(math.exp(sum(logs) / history))
    return out


class HintSteal(StealPolicy):
    """steal with each sequence's remaining work estimated from its prompt's hint."""

    def __init__(self, cfg: PolicyConfig, cost: CostModel, hints: list, sigma: float = GROUP_SIGMA):
        super().__init__(cfg, cost)
        self.log_hints = [math.log(max(1.0, h)) for h in hints]
        self.sigma = sigma

    def _load(self, view, rep, typical, starts=(), running_only=False):
        load = super()._load(view, rep, typical, starts, running_only)  # the same rows and contexts
        rem = np.array([lognormal_remaining(max(1, s.generated), self.log_hints[s.request.prompt_index],
                                            self.sigma, s.request.sampling.max_tokens) for s in load.seqs])
        return Load(np.maximum(1.0, rem), load.ctx, load.seqs, self.cost)


class TwoClassHintSteal(HintSteal):
    """HintSteal whose first placement puts the samples of the `tail_groups` prompts with the
    longest hints on `tail_replicas` replicas (round robin) and nothing else there; the other
    replicas pull the rest (spread two samples of a group at a time). Steal runs once the queue
    is empty, as shipped."""

    def __init__(self, cfg, cost, hints, tail_groups: int, tail_replicas: int):
        super().__init__(cfg, cost, hints)
        self.tail_groups, self.tail_replicas = tail_groups, tail_replicas
        self.plan = None  # seq_id -> tail replica

    def _make_plan(self, view) -> None:
        fresh = list(view.queue.fresh.values())
        prompts = sorted({s.request.prompt_index for s in fresh}, key=lambda p: -self.log_hints[p])
        tail = set(prompts[:self.tail_groups])
        reps = sorted(view.replicas)[:self.tail_replicas]
        self.tail_set = set(reps)
        planned = [s for s in fresh if s.request.prompt_index in tail]
        self.plan = {s.seq_id: reps[i % len(reps)] for i, s in enumerate(planned)}

    def decide(self, view, replica_id):
        q = view.queue
        if self.plan is None and q.fresh:
            self._make_plan(view)
        if self.plan is None or not q.fresh:
            return super().decide(view, replica_id)
        free = view.replicas[replica_id].free_slots
        if replica_id in self.tail_set:  # tail replicas take only their planned work while any is queued
            mine = [s for s in q.fresh.values() if self.plan.get(s.seq_id) == replica_id][:free]
            return Decision(assign=[Assign(s, replica_id) for s in mine])
        out = list(q.continuations.values())[:free]
        lanes = [[s for s in g.values() if s.seq_id not in self.plan] for g in q.fresh_by_group.values()]
        for i in range(0, max((len(lane) for lane in lanes), default=0), 2):
            for lane in lanes:
                out += lane[i:i + 2][:free - len(out)]
        if out:
            return Decision(assign=[Assign(s, replica_id) for s in out[:free]])
        # Nothing unplanned left: steal's own pass (it refreshes this replica's finish estimate),
        # minus any planned work it would take (that is the tail replicas' alone).
        decision = super().decide(view, replica_id)
        decision.assign = [a for a in decision.assign if a.seq.seq_id not in self.plan]
        return decision


def lengths_and_own(reqs, cost: CostModel) -> tuple:
    """Each sequence's true length and its own decode cost (estimate.own_costs from its prompt)."""
    lengths = np.array([min(r.hidden_length, r.sampling.max_tokens) for r in reqs], dtype=np.float64)
    return lengths, own_costs(lengths, np.array([r.prompt_len for r in reqs], dtype=np.float64), cost)


def additive_balance(reqs, cost: CostModel, replicas: int) -> float:
    """a * L_max + the batch's own decode costs / R (module docstring)."""
    lengths, own = lengths_and_own(reqs, cost)
    return float(cost.a * lengths.max() + own.sum() / replicas)


def greedy_placement(reqs, cost: CostModel, replicas: int, capacity: int) -> tuple:
    """With the true lengths: each sequence, longest first, to the replica (with a free slot)
    whose a * (longest) + own costs grows least. Returns (that maximum, replica of each sequence)."""
    lengths, own = lengths_and_own(reqs, cost)
    longest, owns, count = np.zeros(replicas), np.zeros(replicas), np.zeros(replicas, dtype=int)
    where = np.zeros(len(reqs), dtype=int)
    for i in np.argsort(-lengths, kind="stable"):
        after = cost.a * np.maximum(longest, lengths[i]) + owns + own[i]
        after[count >= capacity] = np.inf
        r = int(np.argmin(after))
        longest[r], owns[r], count[r], where[i] = max(longest[r], lengths[i]), owns[r] + own[i], count[r] + 1, r
    return float((cost.a * longest + owns).max()), where


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", default="a100-80g-7b")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--variants", default="steal,hint")
    ap.add_argument("--history", type=int, default=0, help="samples per prompt in the history (0: exact difficulty)")
    ap.add_argument("--drift", type=float, default=0.0, help="sigma of the log-difficulty change since the history")
    ap.add_argument("--tail-groups", type=int, default=8)
    ap.add_argument("--tail-replicas", type=int, default=6)
    a = ap.parse_args()
    cost = load_profile(a.profile, 256)
    for seed in (int(x) for x in a.seeds.split(",")):
        spec = LongtailSpec(seed=seed)  # the seed scale
        reqs = rl_longtail(spec)
        hints = prompt_hints(spec, a.history, a.drift)
        balance = balance_bound(reqs, cost, 32)
        lower = bounds(reqs, cost, 32)["lower_bound_s"]
        lengths, _ = lengths_and_own(reqs, cost)
        prompt_of = np.array([r.prompt_index for r in reqs])
        at_cap = lengths >= spec.max_tokens
        print(json.dumps({"seed": seed, "balance_bound_s": round(balance, 2), "lower_bound_s": round(lower, 2),
                          "at_cap": int(at_cap.sum()), "prompts_with_one_at_cap": len(set(prompt_of[at_cap])),
                          "log_corr_hint_length": round(float(np.corrcoef(
                              np.log(lengths), np.log(np.array(hints))[prompt_of])[0, 1]), 3),
                          "additive_balance_s": round(additive_balance(reqs, cost, 32), 2),
                          "greedy_placement_s": round(greedy_placement(reqs, cost, 32, cost.max_num_seqs)[0], 2)}),
              flush=True)
        for variant in filter(None, a.variants.split(",")):
            cfg = PolicyConfig(name="steal")
            policy = {"steal": lambda: StealPolicy(cfg, cost), "hint": lambda: HintSteal(cfg, cost, hints),
                      "hint-two-class": lambda: TwoClassHintSteal(cfg, cost, hints, a.tail_groups, a.tail_replicas),
                      }[variant]()
            res = Simulation(policy, cost, 32, trace=False).run(reqs)
            print(json.dumps({"seed": seed, "variant": variant, "history": a.history, "drift": a.drift,
                              "makespan_s": round(res.makespan_s, 2), "to_balance_bound": round(res.makespan_s / balance, 4),
                              "to_lower_bound": round(res.makespan_s / lower, 4),
                              "migrations": res.counters["migrations"]}), flush=True)


if __name__ == "__main__":
    main()
