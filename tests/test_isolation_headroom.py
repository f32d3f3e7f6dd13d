"""experiments/isolation-headroom/run.py: its bounds bracket correctly and its oracle placement completes."""

from rollout_cluster.bench.bounds import bounds
from rollout_cluster.bench.workloads import LongtailSpec, rl_longtail
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.sim.simulator import Simulation

SPEC = LongtailSpec(prompts=24, samples=8, median=300.0, max_tokens=2048, seed=1, prompt_min=32, prompt_max=128)


def test_informed_bound_lies_between_the_lower_and_balance_bounds_and_grows_with_g(headroom):
    cost = load_profile("a100-80g-7b")
    reqs = rl_longtail(SPEC)
    b = bounds(reqs, cost, 4)
    marks = [16, 128, 512, 1024]
    informed = headroom.informed_bound(reqs, cost, 4, marks)
    values = [informed[g] for g in marks]
    assert values == sorted(values)  # learning later can only cost more
    assert b["longest_alone_s"] <= values[0] + 1e-9
    assert values[-1] <= b["balance_bound_s"] + 1e-9  # isolating at any point beats staying balanced


def test_oracle_isolation_completes_every_sequence_with_the_longest_on_tail_replicas(headroom):
    cost = load_profile("a100-80g-7b")
    reqs = rl_longtail(SPEC)
    policy = headroom.OracleIsolation(reqs, longest=8, tail_replicas=2, cap=4)
    res = Simulation(policy, cost, 4, trace=False).run(reqs)
    assert all(c is not None and c.finish_reason == "length" for c in res.completions)
    longest = sorted(range(len(reqs)), key=lambda i: -reqs[i].hidden_length)[:8]
    for i in longest:
        assert res.completions[i].replicas[0] in ("r00", "r01")
