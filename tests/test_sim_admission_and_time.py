"""The simulator and the simulated engines at four edges: admission leaves room for the running
batch's next tokens, each admission evicts the prefix cache before the next looks it up, a
give-up that empties a replica never takes virtual time backwards, and a paced replica reports an
urgent end once the gap has passed. No Ray, no vLLM."""
import dataclasses

import pytest

from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import SamplingSpec, SequenceRequest, Work
from rollout_cluster.sim.paced import PacedSimulation
from rollout_cluster.sim.simulator import Simulation

from test_sim import ENGINES, run_engine

COST = load_profile("a100-80g-7b", max_num_seqs=64)
SPEC = SamplingSpec(max_tokens=8192, ignore_eos=True)


def work(seq_id, prompt, length, attempt=1, group=None):
    return Work(seq_id, attempt, None, SPEC, stop_after=length, prompt_len=prompt,
                prefix_key=None if group is None else ("b", group), prefix_len=0 if group is None else prompt)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_sequence_is_not_admitted_when_the_running_batch_needs_that_kv_for_its_next_tokens(engine):
    """vLLM schedules the running requests' next tokens first and admits a waiting one only into
    what is left. The engines checked only `context + s.context + 1 <= kv`: a sequence that fits
    the running context but not their next tokens was admitted, charged its whole prefill, and
    preempted in the same step (sim_core.py _admit / sim/engine.py _admit)."""
    cost = dataclasses.replace(COST, kv_tokens=1000)
    e = engine(cost)
    e.submit(work("a", 300, 500))
    e.submit(work("b", 300, 500))
    e.advance(limit_s=0.0)  # both admitted, one decode step
    assert e.context == 602 and len(e.running) == 2
    e.submit(work("c", 1000 - e.context - 1, 50))  # fits the context, not with a and b's next tokens
    dt = e.advance(limit_s=0.0)
    assert e.preemptions == 0
    assert len(e.running) == 2 and len(e.waiting) == 1
    assert dt == pytest.approx(cost.step_s(2, 602), rel=1e-12)  # one decode step, no prefill of c


@pytest.mark.parametrize("engine", ENGINES)
def test_an_admission_evicts_free_entries_before_the_next_admission_of_the_same_step_looks_them_up(engine):
    """prefix_cache.py: free tokens + running context <= capacity after every admission. The
    engines evicted only once all of a step's admissions were made, so a continuation admitted
    after another sequence whose prefill took its blocks still found its context cached."""
    cost = dataclasses.replace(COST, kv_tokens=1000)
    e = engine(cost)
    e.submit(work("x", 200, 100))
    run_engine(e)  # free pool: x's context (300)
    e.submit(work("y", 300, 100))
    run_engine(e)  # free pool: x (300, oldest), y (400)
    assert list(e.prefix_cache.free.values()) == [300, 400]
    e.submit(work("a", 500, 10))  # 500 + 700 free > 1000: its prefill evicts x, the oldest
    e.submit(work("x", 300, 10, attempt=2))  # x's continuation, after a in the same step
    dt = e.advance(limit_s=0.0)
    assert len(e.running) == 2
    assert e.prefix_cache.seq_hits == 0  # x's blocks went to a
    assert e.prefix_cache.free_tokens + e.context <= cost.kv_tokens
    assert dt >= cost.prefill_s(500 + 300)


@pytest.mark.parametrize("sim_cls", [Simulation, PacedSimulation])
def test_a_give_up_that_empties_a_replica_does_not_take_virtual_time_backwards(sim_cls):
    """A give-up of a replica's last sequence leaves it idle with the abort's final. Its next event
    is a pull interval later, but `_advance` left its clock where it was (finals present) and `run`
    set `now` back to that clock: the report was applied after the other replicas' later pulls,
    stamped earlier (simulator.py _advance / run, paced.py _advance)."""
    reqs = [SequenceRequest(None, SPEC, 0, 0, hidden_length=1000, prompt_len=100)]
    policy = make_policy(PolicyConfig(name="scripted", scripted_at_tokens=[100]), COST)
    sim = sim_cls(policy, COST, 2)
    res = sim.run(reqs)
    assert res.completions[0].finish_reason == "length"
    assert sim.pull_times == sorted(sim.pull_times)
    for rid, points in res.trace.items():
        times = [t for t, _ in points]
        assert times == sorted(times), rid


def test_paced_replica_reports_an_urgent_end_once_the_gap_has_passed_not_at_the_next_interval():
    """PullLoop.pace reports an end at urgent_from (gap fraction of the interval) when work is
    queued. PacedSimulation checked urgency only after each advance, which ran to the next end or
    the interval's end: an end before urgent_from was reported at the interval's end."""
    cost = load_profile("a100-80g-7b", max_num_seqs=2)
    reqs = [SequenceRequest(None, SPEC, i, 0, hidden_length=n, prompt_len=100) for i, n in enumerate([10, 5000, 100])]
    sim = PacedSimulation(make_policy(PolicyConfig(name="pull"), cost), cost, 1, pull_interval_s=1.0,
                          urgent_gap_frac=0.5)
    res = sim.run(reqs)
    step = cost.step_s(2, 2 * 200)
    assert cost.prefill_s(200) + 10 * step < 0.2  # the first ends at ~0.1 s, the third is queued
    assert 0.5 <= sim.pull_times[1] <= 0.5 + 2 * step  # reported once the gap has passed
    assert res.completions[0].finish_time_s == sim.pull_times[1]
