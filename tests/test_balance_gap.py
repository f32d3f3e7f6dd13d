"""experiments/balance-gap/run.py: its step clock, its fluid milestones and its oracle steal."""
import math

import pytest

from rollout_cluster.bench.bounds import balance_bound, bounds, fluid_schedule
from rollout_cluster.bench.workloads import LongtailSpec, rl_longtail
from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.sim.simulator import Simulation

SPEC = LongtailSpec(prompts=16, samples=8, median=300.0, max_tokens=2048, seed=2, prompt_min=32, prompt_max=128)


def test_time_at_step_interpolates_within_an_advance_and_counts_prefill_before_it(balance_gap):
    runs = [(10, 1.0), (0, 0.5), (10, 2.0)]  # the middle advance only prefilled
    assert balance_gap.time_at_step(runs, 5) == pytest.approx(0.5)
    assert balance_gap.time_at_step(runs, 10) == pytest.approx(1.0)
    assert balance_gap.time_at_step(runs, 15) == pytest.approx(2.5)
    assert math.isnan(balance_gap.time_at_step(runs, 21))


def test_fluid_milestones_rise_and_the_last_step_ends_at_the_balance_bound(balance_gap):
    cost = load_profile("a100-80g-7b")
    reqs = rl_longtail(SPEC)
    fluid = list(fluid_schedule(reqs, cost, 4))
    last = fluid[-1].steps + fluid[-1].k
    marks = [balance_gap.fluid_time_at_step(fluid, m) for m in (1, last // 4, last // 2, last)]
    assert marks == sorted(marks) and marks[0] > 0
    assert marks[-1] == pytest.approx(balance_bound(reqs, cost, 4))


def test_oracle_steal_sees_true_remaining_lengths_and_completes_the_batch_once(balance_gap):
    cost = load_profile("a100-80g-7b", max_num_seqs=16)
    reqs = rl_longtail(SPEC)
    policy = balance_gap.OracleSteal(PolicyConfig(name="steal", spread_chunk=2), cost)
    seen = []
    load = policy._load

    def spy(view, rep, typical, starts=(), running_only=False):
        out = load(view, rep, typical, starts, running_only)
        seen.extend((s.request.hidden_length - s.generated, r) for s, r in zip(out.seqs, out.rem))
        return out

    policy._load = spy
    sim = Simulation(policy, cost, 4, trace=False, engine=balance_gap.StepClockEngine, record_tokens=True)
    res = sim.run(reqs)
    assert seen and all(r == max(1.0, true) for true, r in seen)
    assert all(c is not None and c.finish_reason == "length" and len(c.token_ids) == q.hidden_length
               for c, q in zip(res.completions, reqs))
    assert res.makespan_s >= bounds(reqs, cost, 4)["lower_bound_s"] - 1e-9
    for rid, engine in sim.engines.items():  # the step clock saw every busy second
        assert sum(dt for _, dt in engine.runs) == pytest.approx(sim.busy[rid])
