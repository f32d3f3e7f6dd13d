"""The simulator against closed forms, the fast engine against the reference engine, and the
bounds against simulated makespans. No Ray, no vLLM."""
import dataclasses

import pytest

from rollout_cluster.bench.bounds import alone_s, balance_bound, bounds, decode_alone_s, lower_bound
from rollout_cluster.bench.workloads import LongtailSpec, rl_longtail
from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.engines.sim_core import SimEngineCore
from rollout_cluster.policy import Decision, Policy, make_policy
from rollout_cluster.sim.engine import FastEngineCore
from rollout_cluster.sim.simulator import Simulation
from rollout_cluster.protocol import SamplingSpec, SequenceRequest, Work

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
    # one sample per prompt: no prefix-cache hits, every sequence pays its prefill
    reqs = [SequenceRequest(None, SPEC, i, 0, hidden_length=1000, prompt_len=300)
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
    pc = {"chunk_tokens": 256} if policy == "chunked" else {}
    ref = run(policy, reqs, 4, cost, SimEngineCore, record_tokens=True, **pc)
    fast = run(policy, reqs, 4, cost, FastEngineCore, record_tokens=True, **pc)
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
    first = {}
    for i, r in enumerate(reqs):
        first.setdefault(r.prompt_index, i)  # the first of a group pays the shared prompt's prefill
    assert len(first) == 24 < len(reqs)
    work = sum((r.prompt_len / COST.prefill_tokens_per_s if first[r.prompt_index] == i else 0.0)
               + sum(COST.a / COST.max_num_seqs + COST.e + COST.c * (r.prompt_len + j) for j in range(r.hidden_length))
               for i, r in enumerate(reqs))
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
        engine.submit(Work(f"s{i}", 1, None, r.sampling, stop_after=r.hidden_length, prompt_len=r.prompt_len,
                           prefix_key=("sim", r.prompt_index), prefix_len=r.prompt_len))
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


# ---- prefix cache (engines/prefix_cache.py) --------------------------------------------

ENGINES = [FastEngineCore, SimEngineCore]


def prefix_work(seq_id, group, prompt, length, prefix_len=None):
    """A segment of group `group` whose prompt is `prompt` tokens, the first `prefix_len` of
    them (default: all) the group's shared prompt."""
    return Work(seq_id, 1, None, SPEC, stop_after=length, prompt_len=prompt, prefix_key=("b", group),
                prefix_len=prompt if prefix_len is None else prefix_len)


def run_engine(engine) -> float:
    t = 0.0
    while engine.busy:
        t += engine.advance()
    return t


@pytest.mark.parametrize("engine", ENGINES)
def test_prefix_cache_group_siblings_pay_the_prompt_once_per_replica(engine):
    prompt, length = 1000, 500
    reqs = [SequenceRequest(None, SPEC, 0, j, hidden_length=length, prompt_len=prompt) for j in range(2)]
    one_prefill = prompt / COST.prefill_tokens_per_s
    # one replica: the first sample prefills the prompt, the second finds it cached
    together = closed_form(COST, 2, prompt, length) - one_prefill
    res = run("pull", reqs, 1, engine=engine)
    assert res.busy_s["r00"] == pytest.approx(together, rel=1e-9)
    assert res.makespan_s == pytest.approx(together, rel=1e-9)
    # by hand: one prefill, then `length` steps of 2 sequences at context 2*(prompt + j)
    by_hand = one_prefill + sum(COST.a + 2 * COST.e + COST.c * 2 * (prompt + j) for j in range(length))
    assert together == pytest.approx(by_hand, rel=1e-12)
    # two replicas, one sample each: each pays the prompt's prefill
    res = run("pull", reqs, 2, engine=engine)
    assert sorted(c.replicas[0] for c in res.completions) == ["r00", "r01"]
    assert list(res.busy_s.values()) == pytest.approx([alone_s(COST, prompt, length)] * 2, rel=1e-9)
    assert alone_s(COST, prompt, length) == pytest.approx(closed_form(COST, 1, prompt, length), rel=1e-12)
    # the same two on one engine without prefix keys: both pay (the behaviour before the cache)
    e = engine(COST, emit_tokens=False)
    for j in range(2):
        e.submit(Work(f"s{j}", 1, None, SPEC, stop_after=length, prompt_len=prompt))
    assert run_engine(e) == pytest.approx(closed_form(COST, 2, prompt, length), rel=1e-9)


@pytest.mark.parametrize("engine", ENGINES)
def test_prefix_cache_continuation_pays_only_its_partial_output(engine):
    prompt, partial, length = 1000, 300, 50
    rate = COST.prefill_tokens_per_s
    decode = decode_alone_s(COST, prompt + partial, length)
    # group cached by a finished sibling: the continuation (prompt + partial) prefills the partial only
    e = engine(COST, emit_tokens=False)
    e.submit(prefix_work("sibling", 0, prompt, 20))
    run_engine(e)
    e.submit(prefix_work("cont", 0, prompt + partial, length, prefix_len=prompt))
    assert run_engine(e) == pytest.approx(partial / rate + decode, rel=1e-9)
    # only another group cached: the whole prompt + partial is prefilled
    e = engine(COST, emit_tokens=False)
    e.submit(prefix_work("other", 1, prompt, 20))
    run_engine(e)
    e.submit(prefix_work("cont", 0, prompt + partial, length, prefix_len=prompt))
    assert run_engine(e) == pytest.approx((prompt + partial) / rate + decode, rel=1e-9)
    assert (prompt + partial) / rate + decode == pytest.approx(alone_s(COST, prompt + partial, length), rel=1e-12)


def test_router_gives_every_segment_its_group_and_prompt_length():
    works = []

    class Recording(FastEngineCore):
        def submit(self, work):
            works.append(work)
            super().submit(work)

    reqs = small_longtail()
    res = run("scripted", reqs, 4, engine=Recording, scripted_at_tokens=[100, 300])
    assert res.counters["migrations"] > 0
    by_id = {f"sim:{i}": r for i, r in enumerate(reqs)}
    continuations = [w for w in works if w.prompt_len > w.prefix_len]
    assert len(continuations) == len(works) - len(reqs) > 0
    for w in works:
        r = by_id[w.seq_id]
        assert w.prefix_key == ("sim", r.prompt_index) and w.prefix_len == r.prompt_len
    # re-prefill accounting is the router's (prompt + partial of each continuation), cache or not
    assert res.reprefill_tokens == sum(w.prompt_len for w in continuations) == res.counters["reprefill_tokens"]


@pytest.mark.parametrize("engine", ENGINES)
def test_prefix_cache_evicts_free_prompts_oldest_first_when_kv_fills(engine):
    prompt = 1000
    cost = dataclasses.replace(COST, kv_tokens=7000)
    rate = cost.prefill_tokens_per_s
    e = engine(cost, emit_tokens=False)
    e.submit(prefix_work("g0", 0, prompt, 10))
    e.submit(prefix_work("g1", 1, prompt, 10))
    run_engine(e)  # both finished: groups 0 and 1 and each sequence's own context cached, 0 the older
    pc = e.prefix_cache
    assert list(pc.free) == [("b", 0), ("seq", "g0"), ("b", 1), ("seq", "g1")] and not pc.held
    assert pc.free_tokens == 2 * prompt + 2 * (prompt + 10)
    # a sequence whose context reaches 3000 + 1000: free 4020 + context > 7000, so the oldest two go
    e.submit(prefix_work("big", 2, 3000, 1000))
    run_engine(e)
    assert list(pc.free) == [("b", 1), ("seq", "g1"), ("b", 2), ("seq", "big")] and pc.evictions == 2
    # group 1 is still cached: no prefill
    e.submit(prefix_work("again1", 1, prompt, 10))
    assert run_engine(e) == pytest.approx(closed_form(cost, 1, prompt, 10) - prompt / rate, rel=1e-9)
    # group 0 was evicted: it pays its prompt again
    e.submit(prefix_work("again0", 0, prompt, 10))
    assert run_engine(e) == pytest.approx(closed_form(cost, 1, prompt, 10), rel=1e-9)


@pytest.mark.parametrize("engine", ENGINES)
def test_prefix_cache_never_evicts_a_prompt_that_running_sequences_hold(engine):
    cost = dataclasses.replace(COST, kv_tokens=4000)
    e = engine(cost, emit_tokens=False)
    e.submit(prefix_work("other", 1, 1500, 10))
    run_engine(e)  # group 1 (1500) and sequence "other" (1510) cached, free
    e.submit(prefix_work("a", 0, 1000, 1900))  # admitted: 3010 free + 1000 > 4000, group 1 goes
    while e.steps < 10 + 1700:  # a's context reaches 2700: free 1510 + 2700 > 4000, "other" goes
        e.advance(max_steps=10 + 1700 - e.steps)
    pc = e.prefix_cache
    assert not pc.free and pc.evictions == 2 and pc.held == {("b", 0): 1}
    e.submit(prefix_work("b", 0, 1000, 10))  # a sibling arrives: a holds the prompt, so it is cached
    assert e.advance(max_steps=1) == pytest.approx(cost.step_s(2, 2700 + 1000), rel=1e-12)  # no prefill
    assert pc.hits == 1 and pc.held == {("b", 0): 2} and pc.evictions == 2
    run_engine(e)
    assert list(pc.free) == [("seq", "b"), ("b", 0), ("seq", "a")] and not pc.held and e.preemptions == 0


@pytest.mark.parametrize("policy", ["scripted", "least-loaded", "steal", "chunked"])
def test_fast_engine_equals_reference_engine_with_prefix_cache_evictions(policy):
    """Prefix keys on every segment (the router sets them), continuations (forced migrations,
    chunked rounds), and a KV small enough that free prompts are evicted and sequences preempted."""
    cost = dataclasses.replace(COST, kv_tokens=8000, max_num_seqs=32)
    reqs = rl_longtail(LongtailSpec(prompts=16, samples=6, median=400, max_tokens=4096))
    results, caches = [], []
    pc = {"chunked": {"chunk_tokens": 256}, "scripted": {"scripted_at_tokens": [100, 300]}}.get(policy, {})
    for engine in ENGINES:
        sim = Simulation(make_policy(PolicyConfig(name=policy, **pc), cost), cost, 4, engine=engine, record_tokens=True)
        results.append(sim.run(reqs))
        caches.append([(p.hits, p.hit_tokens, p.evictions, list(p.free), dict(p.held))
                       for p in (e.prefix_cache for e in sim.engines.values())])
    fast, ref = results
    assert fast.makespan_s == ref.makespan_s and fast.finish_times == ref.finish_times
    assert fast.counters == ref.counters and fast.preemptions == ref.preemptions
    assert fast.busy_s == ref.busy_s and fast.trace == ref.trace
    assert [c.token_ids for c in fast.completions] == [c.token_ids for c in ref.completions]
    assert caches[0] == caches[1]
    assert fast.reprefilled_tokens == ref.reprefilled_tokens <= ref.reprefill_tokens
    if policy in ("scripted", "chunked"):  # continuations were dispatched, and not all of them hit the cache
        assert ref.reprefilled_tokens > 0
    assert sum(c[0] for c in caches[0]) > 0 and sum(c[2] for c in caches[0]) > 0 and ref.preemptions > 0
    assert all(not c[4] for c in caches[0])  # nothing runs at the end: every prompt released


def test_host_slowdown_stretches_steps_only_while_another_replica_is_busy():
    """Replicas sharing a host: a step takes (1 + s) as long while the other replica works."""
    def sim(reqs, slowdown):
        s = Simulation(make_policy(PolicyConfig(name="static"), COST), COST, 2, pull_interval_s=0.05,
                       host_slowdown=slowdown)
        return s.run(reqs)

    alone = closed_form(COST, 1, 500, 2000)
    one = [SequenceRequest(None, SPEC, 0, 0, hidden_length=2000, prompt_len=500)]
    assert sim(one, 0.25).makespan_s == pytest.approx(alone, rel=1e-6)  # the other replica idles
    # static splits contiguously: one sequence per replica, both busy throughout
    two = one + [SequenceRequest(None, SPEC, 1, 0, hidden_length=2000, prompt_len=500)]
    assert sim(two, 0.0).makespan_s == pytest.approx(alone, rel=1e-6)
    assert sim(two, 0.25).makespan_s == pytest.approx(1.25 * alone, rel=1e-3)
    # once the short one ends, the long one runs at full speed again
    short = [one[0], SequenceRequest(None, SPEC, 1, 0, hidden_length=500, prompt_len=500)]
    res = sim(short, 0.25)
    t_short = 1.25 * closed_form(COST, 1, 500, 500)
    expected = t_short + (alone - closed_form(COST, 1, 500, 500))
    # replicas advance a pull interval at a time, so the switch is seen within one of them
    assert res.makespan_s == pytest.approx(expected, abs=0.05 * 0.25)
    assert alone < res.makespan_s < 1.25 * alone
    with pytest.raises(ValueError, match="host_slowdown=-0.1"):
        Simulation(make_policy(PolicyConfig(name="static"), COST), COST, 2, host_slowdown=-0.1)


def test_engine_counts_ended_segments_before_they_are_drained():
    """`ended` (EngineAdapter) grows with every final report, natural or aborted, before drain()
    hands it over: a paced replica reports at once when it changes."""
    core = SimEngineCore(COST)
    core.submit(Work("short", 1, None, SPEC, stop_after=3, prompt_len=16))
    core.submit(Work("long", 1, None, SPEC, stop_after=1000, prompt_len=16))
    assert core.ended == 0
    while core.ended == 0:
        core.advance(limit_s=0.01)
    assert core.ended == 1
    core.abort([("long", 1)])
    assert core.ended == 2
    finals = sorted((p.seq_id, p.finish_reason) for p in core.drain() if p.finish_reason)
    assert finals == [("long", "abort"), ("short", "length")]
    assert core.ended == 2 and core.drain() == []
