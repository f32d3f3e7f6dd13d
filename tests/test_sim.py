"""The simulator against closed forms, the fast engine against the reference engine, and the
bounds against simulated makespans. No Ray, no vLLM."""
import dataclasses

import pytest

from rollout_cluster.bench.bounds import alone_s, balance_bound, bounds, lower_bound
from rollout_cluster.bench.workloads import LongtailSpec, rl_longtail
from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.engines.sim_core import SimEngineCore
from rollout_cluster.policy import Decision, Policy, make_policy
from rollout_cluster.sim.engine import FastEngineCore
from rollout_cluster.sim.simulator import Simulation
from rollout_cluster.types import SamplingSpec, SequenceRequest, Work

COST = load_profile("a100-80g-7b", max_num_seqs=64)
POLICIES = ["static", "chunked", "least-loaded", "pull", "steal"]
SPEC = SamplingSpec(max_tokens=4096, ignore_eos=True)


def run(policy, requests, replicas, cost=COST, engine=FastEngineCore, record_tokens=False, **pc):
    sim = Simulation(make_policy(PolicyConfig(name=policy, **pc), cost), cost, replicas, engine=engine,
                     record_tokens=record_tokens)
    return sim.run(requests)


def closed_form(cost, batch, prompt, length):
    """`batch` identical sequences decoded together on one replica: one prefill of all prompts,
    then `length` steps, step j costing a + e*batch + c*batch*(prompt + j)."""
    t = batch * prompt / cost.prefill_tokens_per_s
    for j in range(length):
        t += cost.a + cost.e * batch + cost.c * batch * (prompt + j)
    return t


def small_longtail(seed=0):
    return rl_longtail(LongtailSpec(prompts=24, samples=8, median=300, max_tokens=4096, seed=seed))


@pytest.mark.parametrize("policy", ["pull", "steal", "static"])
def test_one_sequence_alone_matches_closed_form(policy):
    req = [SequenceRequest(None, SPEC, 0, 0, hidden_length=3000, prompt_len=500)]
    res = run(policy, req, replicas=4)
    expected = closed_form(COST, 1, 500, 3000)
    assert res.makespan_s == pytest.approx(expected, rel=1e-6)
    assert alone_s(COST, 500, 3000) == pytest.approx(expected, rel=1e-9)
    # a sequence is indivisible: perfect balance cannot make it faster than alone
    assert balance_bound(req, COST, 4) == pytest.approx(expected, rel=1e-9)
    assert res.completions[0].finish_time_s == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("policy", ["static", "pull", "least-loaded"])
def test_even_split_without_tail_finishes_together(policy):
    replicas, per_replica = 4, 32
    reqs = [SequenceRequest(None, SPEC, i // 4, i % 4, hidden_length=1000, prompt_len=300)
            for i in range(replicas * per_replica)]
    res = run(policy, reqs, replicas)
    expected = closed_form(COST, per_replica, 300, 1000)
    assert max(res.finish_times) - min(res.finish_times) < 1e-9  # no tail at all
    assert res.makespan_s == pytest.approx(expected, rel=1e-6)
    assert balance_bound(reqs, COST, replicas) == pytest.approx(expected, rel=1e-9)
    busy = list(res.busy_s.values())
    assert busy == pytest.approx([expected] * replicas, rel=1e-6)


def test_kv_overflow_preempts_and_still_completes_exactly():
    tiny = dataclasses.replace(COST, kv_tokens=6000)
    reqs = rl_longtail(LongtailSpec(prompts=6, samples=4, median=400, max_tokens=2048, prompt_min=64, prompt_max=128))
    res = run("pull", reqs, replicas=2, cost=tiny, record_tokens=True)
    assert res.preemptions > 0
    for req, c in zip(reqs, res.completions):
        assert c.finish_reason == "length"
        assert len(c.token_ids) == req.hidden_length
    ample = run("pull", reqs, replicas=2, record_tokens=True)
    assert ample.preemptions == 0 and res.makespan_s > ample.makespan_s  # recompute costs time


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("kv_tokens", [None, 20000])
def test_fast_engine_equals_reference_engine(policy, kv_tokens):
    cost = COST if kv_tokens is None else dataclasses.replace(COST, kv_tokens=kv_tokens, max_num_seqs=32)
    reqs = rl_longtail(LongtailSpec(prompts=16, samples=6, median=400, max_tokens=4096))
    ref = run(policy, reqs, 4, cost, SimEngineCore, record_tokens=True, chunk_tokens=256)
    fast = run(policy, reqs, 4, cost, FastEngineCore, record_tokens=True, chunk_tokens=256)
    assert fast.makespan_s == ref.makespan_s
    assert fast.finish_times == ref.finish_times
    assert fast.counters == ref.counters and fast.preemptions == ref.preemptions
    assert fast.busy_s == ref.busy_s and fast.trace == ref.trace
    assert [c.token_ids for c in fast.completions] == [c.token_ids for c in ref.completions]
    if kv_tokens:
        assert ref.preemptions > 0


def test_lower_bound_terms_have_closed_forms():
    reqs = small_longtail()
    lb = lower_bound(reqs, COST, 4)
    assert lb["longest_alone_s"] == pytest.approx(max(closed_form(COST, 1, r.prompt_len, r.hidden_length)
                                                      for r in reqs), rel=1e-9)
    work = sum(r.prompt_len / COST.prefill_tokens_per_s
               + sum(COST.a / COST.max_num_seqs + COST.e + COST.c * (r.prompt_len + j) for j in range(r.hidden_length))
               for r in reqs)
    assert lb["work_s"] == pytest.approx(work, rel=1e-9)
    assert lb["lower_bound_s"] == max(lb["longest_alone_s"], lb["work_s"] / 4)


def test_balance_bound_is_not_below_the_work_term_when_the_fleet_is_the_limit():
    reqs = rl_longtail(LongtailSpec(prompts=64, samples=8, median=300, sigma_prompt=0.1, sigma_sample=0.1,
                                    max_tokens=1024))
    b = bounds(reqs, COST, 2)
    assert b["work_s"] / 2 > b["longest_alone_s"]  # the fleet, not one sequence, limits here
    assert b["lower_bound_s"] <= b["balance_bound_s"]


@pytest.mark.parametrize("seed", [0, 1])
def test_bounds_hold_against_every_policy(seed):
    reqs = small_longtail(seed)
    replicas = 4
    b = bounds(reqs, COST, replicas)
    spans = {p: run(p, reqs, replicas).makespan_s for p in POLICIES}
    assert all(b["lower_bound_s"] <= s * (1 + 1e-9) for s in spans.values()), (b, spans)
    assert b["lower_bound_s"] <= b["balance_bound_s"] <= spans["static"]
    assert b["balance_bound_s"] <= spans["chunked"]  # re-prefill rounds cannot beat perfect balance


def test_single_replica_pull_matches_a_plain_engine():
    """One replica under pull, refilled at every finish, against the whole batch handed to one
    engine at once (what a bare vLLM engine does): the router adds no virtual time."""
    reqs = small_longtail()
    res = run("pull", reqs, 1)
    engine = FastEngineCore(COST, emit_tokens=False)
    for i, r in enumerate(reqs):
        engine.submit(Work(f"s{i}", 1, None, r.sampling, stop_after=r.hidden_length, prompt_len=r.prompt_len))
    t = 0.0
    while engine.busy:
        t += engine.advance()
    assert res.makespan_s == pytest.approx(t, rel=1e-9)


def test_reprefill_counts_migrations_and_chunked_rounds():
    reqs = small_longtail()
    moved = run("scripted", reqs, 4, scripted_at_tokens=[100, 300])  # forced migrations
    assert moved.counters["migrations"] > len(reqs)
    assert moved.reprefill_tokens == moved.counters["reprefill_tokens"]  # the router sees migrations
    chunk = 256
    chunked = run("chunked", reqs, 4, chunk_tokens=chunk)
    # a sequence of length L is re-dispatched after every full chunk, with prompt + k*chunk tokens
    expected = sum(r.prompt_len + k * chunk for r in reqs for k in range(1, -(-r.hidden_length // chunk)))
    assert expected > 0 and chunked.reprefill_tokens == expected
    assert chunked.counters["reprefill_tokens"] == 0  # what the router alone would report


def test_a_stalled_simulation_fails_instead_of_spinning():
    class Idle(Policy):
        def decide(self, view, replica_id):
            return Decision()

    sim = Simulation(Idle(), COST, 2, max_virtual_s=100.0)
    with pytest.raises(RuntimeError, match="unfinished"):
        sim.run(small_longtail())
