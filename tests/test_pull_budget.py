"""Paced reports in the simulator (sim/paced.py, experiments/pull-budget/run.py): with work queued, an
ended segment is reported early, but not before half the interval since the replica's last pull."""
import collections

import pytest

from rollout_cluster.bench.workloads import LongtailSpec, rl_longtail
from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.sim.paced import PacedSimulation
from rollout_cluster.sim.simulator import Simulation

# 4 replicas of 8 slots, 128 sequences: most of the batch waits in the router's queue at first
SPEC = LongtailSpec(prompts=16, samples=8, median=200.0, max_tokens=1024, seed=1, prompt_min=32, prompt_max=64)
INTERVAL = 0.5


def simulate(cls, **kw):
    cost = load_profile("a100-80g-7b", max_num_seqs=8)
    sim = cls(make_policy(PolicyConfig(name="steal"), cost), cost, 4, pull_interval_s=INTERVAL, trace=False,
              record_tokens=True, **kw)
    per_replica = collections.defaultdict(list)
    report = sim._report

    def spy(rid, first):
        per_replica[rid].append(sim.clock[rid] if sim.engines[rid].busy else None)
        return report(rid, first)

    sim._report = spy
    res = sim.run(rl_longtail(SPEC))
    return sim, res, per_replica


def shortest_gaps(pull_times_by_replica: dict) -> float:
    gaps = []
    for times in pull_times_by_replica.values():
        busy = [t for t in times if t is not None]
        gaps += [b - a for a, b in zip(busy, busy[1:])]
    return min(gaps)


@pytest.mark.parametrize("gap", [0.0, 0.5])
def test_every_sequence_completes_once(gap):
    _, res, _ = simulate(PacedSimulation, urgent_gap_frac=gap)
    assert len(res.completions) == 128 and all(c is not None for c in res.completions)
    assert sorted((c.prompt_index, c.sample_index) for c in res.completions) == \
        sorted((p, s) for p in range(16) for s in range(8))
    assert [len(c.token_ids) for c in res.completions] == [r.hidden_length for r in rl_longtail(SPEC)]


def test_a_busy_replica_pulls_no_sooner_than_the_gap_with_pacing_and_sooner_without():
    sim, _, paced = simulate(PacedSimulation, urgent_gap_frac=0.5)
    _, _, eager = simulate(PacedSimulation, urgent_gap_frac=0.0)
    assert shortest_gaps(paced) >= 0.5 * INTERVAL - 1e-9
    assert shortest_gaps(eager) < 0.25 * INTERVAL  # queued work makes ends urgent: they pull early


def test_pacing_sends_fewer_pulls_than_reporting_every_end(pull_budget):
    sim_ideal, ideal, _ = simulate(Simulation)
    sim_paced, paced, _ = simulate(PacedSimulation, urgent_gap_frac=0.5)
    assert len(sim_paced.pull_times) < len(sim_ideal.pull_times)
    assert paced.makespan_s == pytest.approx(ideal.makespan_s, rel=0.25)
    mean, peak = pull_budget.pull_rates(sim_paced.pull_times, paced.makespan_s, skip_s=INTERVAL)
    assert mean == pytest.approx(len(sim_paced.pull_times) / paced.makespan_s)
    assert 0 < peak <= len(sim_paced.pull_times)


def test_the_gap_is_checked():
    cost = load_profile("a100-80g-7b", max_num_seqs=8)
    with pytest.raises(ValueError, match="urgent_gap_frac=1.5"):
        PacedSimulation(make_policy(PolicyConfig(name="steal"), cost), cost, 2, urgent_gap_frac=1.5)
