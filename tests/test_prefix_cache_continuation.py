"""The prefix cache keeps a sequence's own context (prompt + output so far) after it leaves the
batch, so its continuation on the same replica prefills only what is missing
(engines/prefix_cache.py). No Ray, no vLLM."""
import dataclasses

import pytest

import rollout_cluster.engines.sim_core as sim_core
import rollout_cluster.sim.engine as fast_engine
from rollout_cluster.bench.bounds import decode_alone_s
from rollout_cluster.bench.workloads import LongtailSpec, rl_longtail
from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.engines.prefix_cache import PrefixCache, seq_key
from rollout_cluster.engines.sim_core import SimEngineCore
from rollout_cluster.policy import make_policy
from rollout_cluster.sim.engine import FastEngineCore
from rollout_cluster.sim.simulator import Simulation
from rollout_cluster.protocol import SamplingSpec, Work

COST = load_profile("a100-80g-7b", max_num_seqs=64)
SPEC = SamplingSpec(max_tokens=4096, ignore_eos=True)
ENGINES = [FastEngineCore, SimEngineCore]


def without_own_context_cache(monkeypatch):
    """The model before this change: only group prompts are cached."""
    monkeypatch.setattr(fast_engine, "seq_key", lambda seq_id: None)
    monkeypatch.setattr(sim_core, "seq_key", lambda seq_id: None)


def run_engine(engine) -> float:
    t = 0.0
    while engine.busy:
        t += engine.advance()
    return t


def work(seq_id, group, prompt, length, prefix_len, attempt=1):
    return Work(seq_id, attempt, None, SPEC, stop_after=length, prompt_len=prompt, prefix_key=("b", group),
                prefix_len=prefix_len)


def test_a_released_sequence_hits_its_own_context_until_evicted():
    pc = PrefixCache(10_000)
    prompt, context = 500, 1300
    assert pc.admit(("b", 0), prompt, seq_key("s0"), prompt) == 0  # cold: nothing cached
    pc.release(("b", 0), prompt, seq_key("s0"), context)  # left with 800 tokens generated
    assert list(pc.free) == [("b", 0), seq_key("s0")] and pc.free_tokens == prompt + context
    # its continuation (prompt + partial, here 100 more tokens than it had) finds its context cached
    assert pc.admit(("b", 0), prompt, seq_key("s0"), context + 100) == context
    assert pc.seq_hits == 1 and pc.seq_hit_tokens == context and pc.hit_tokens == context
    assert list(pc.free) == [] and pc.free_tokens == 0  # back in the running context
    pc.release(("b", 0), prompt, seq_key("s0"), context + 100)
    # a continuation with less context than cached (e.g. a shorter partial) hits only its own length
    assert pc.admit(("b", 0), prompt, seq_key("s0"), 700) == 700
    pc.release(("b", 0), prompt, seq_key("s0"), context)
    # another sequence of another group: nothing of it is cached
    assert pc.admit(("b", 1), 400, seq_key("x"), 900) == 0
    pc.release(("b", 1), 400, seq_key("x"), 900)
    assert pc.free_tokens == prompt + context + 400 + 900
    # eviction pressure: a running context that leaves room for nothing evicts every free entry
    pc.evict(pc.capacity)
    assert not pc.free and pc.free_tokens == 0 and pc.evictions == 4
    assert pc.admit(("b", 0), prompt, seq_key("s0"), context) == 0


def test_eviction_is_oldest_first_across_group_and_sequence_entries():
    pc = PrefixCache(3000)
    pc.admit(("b", 0), 500, seq_key("a"), 500)
    pc.admit(("b", 1), 500, seq_key("b"), 500)
    pc.release(("b", 0), 500, seq_key("a"), 1000)  # oldest: group 0 (500), then a (1000)
    pc.release(("b", 1), 500, seq_key("b"), 900)  # then group 1 (500), then b (900)
    pc.evict(600)  # 2900 free + 600 > 3000: group 0 goes; 2400 + 600 fits
    assert list(pc.free) == [seq_key("a"), ("b", 1), seq_key("b")] and pc.evictions == 1
    pc.evict(1500)  # a goes, then 1400 + 1500 fits
    assert list(pc.free) == [("b", 1), seq_key("b")] and pc.free_tokens == 1400
    # a lost its own context and its group's prompt: it prefills everything
    assert pc.admit(("b", 0), 500, seq_key("a"), 1000) == 0
    # b still has both: the larger (its own context) counts
    assert pc.admit(("b", 1), 500, seq_key("b"), 1200) == 900


@pytest.mark.parametrize("engine", ENGINES)
def test_a_continuation_on_the_same_replica_prefills_only_new_tokens(engine, monkeypatch):
    prompt, partial, length = 1000, 300, 50
    rate = COST.prefill_tokens_per_s
    decode = decode_alone_s(COST, prompt + partial, length)
    e = engine(COST, emit_tokens=False)
    e.submit(work("s", 0, prompt, partial, prompt))  # a chunk of `partial` tokens, then cut
    run_engine(e)
    e.submit(work("s", 0, prompt + partial, length, prompt, attempt=2))  # its continuation, same replica
    assert run_engine(e) == pytest.approx(decode, rel=1e-9)  # its whole context is cached: no prefill
    assert e.prefix_cache.seq_hits == 1 and e.prefix_cache.seq_hit_tokens == prompt + partial
    # the model before: the group prompt hits, the partial output is prefilled again
    without_own_context_cache(monkeypatch)
    e = engine(COST, emit_tokens=False)
    e.submit(work("s", 0, prompt, partial, prompt))
    run_engine(e)
    e.submit(work("s", 0, prompt + partial, length, prompt, attempt=2))
    assert run_engine(e) == pytest.approx(partial / rate + decode, rel=1e-9)


@pytest.mark.parametrize("engine", ENGINES)
def test_preemption_still_recomputes_when_the_running_sequences_reuse_its_blocks(engine, monkeypatch):
    """KV for 3000 tokens, two 1000-token prompts that share nothing: at 1500 tokens each B (the
    newest) is preempted; A grows into the KV it freed, so B's cached context is evicted and B
    recomputes it all, exactly as before sequences' own contexts were cached."""
    cost = dataclasses.replace(COST, kv_tokens=3000)

    def go():
        e = engine(cost, emit_tokens=False)
        e.submit(Work("A", 1, None, SPEC, stop_after=1000, prompt_len=1000))
        e.submit(Work("B", 1, None, SPEC, stop_after=2000, prompt_len=1000))
        return e, run_engine(e)

    e, t = go()
    pc = e.prefix_cache
    # B's 1500 went first (A grew to 2000), then A's finished 2000 (B came back with 1500)
    assert e.preemptions == 1 and pc.hits == 0 and pc.evictions == 2 and list(pc.free) == [seq_key("B")]
    without_own_context_cache(monkeypatch)
    e_old, t_old = go()
    assert e_old.preemptions == 1 and t == t_old


def simulate(policy, reqs, cost, replicas, **pc):
    sim = Simulation(make_policy(PolicyConfig(name=policy, **pc), cost), cost, replicas)
    res = sim.run(reqs)
    caches = [e.prefix_cache for e in sim.engines.values()]
    return res, caches


@pytest.mark.parametrize("policy", ["chunked", "scripted"])
def test_engines_stay_equivalent_with_own_context_hits_evictions_and_preemptions(policy):
    cost = dataclasses.replace(COST, kv_tokens=8000, max_num_seqs=32)
    reqs = rl_longtail(LongtailSpec(prompts=16, samples=6, median=400, max_tokens=4096))
    out = []
    pc = {"chunked": {"chunk_tokens": 256}, "scripted": {"scripted_at_tokens": [100, 300]}}.get(policy, {})
    for engine in ENGINES:
        sim = Simulation(make_policy(PolicyConfig(name=policy, **pc), cost), cost, 4, engine=engine, record_tokens=True)
        res = sim.run(reqs)
        out.append((res, [(p.hits, p.hit_tokens, p.seq_hits, p.seq_hit_tokens, p.evictions, list(p.free.items()))
                          for p in (e.prefix_cache for e in sim.engines.values())]))
    (fast, fc), (ref, rc) = out
    assert fc == rc
    assert fast.makespan_s == ref.makespan_s and fast.finish_times == ref.finish_times
    assert fast.busy_s == ref.busy_s and fast.trace == ref.trace and fast.preemptions == ref.preemptions > 0
    assert [c.token_ids for c in fast.completions] == [c.token_ids for c in ref.completions]
    assert sum(c[4] for c in fc) > 0
    if policy == "chunked":  # rounds re-submit most sequences to the replica they ran on
        assert sum(c[2] for c in fc) > 0


def test_chunked_pays_little_more_than_pull_now_that_continuations_hit_their_context(monkeypatch):
    """On a real H200, `chunked` (every sequence cut and re-submitted every 1024 tokens) ran
    within 2 % of `static`; re-prefilling every continuation's whole context cost +40 % in the
    simulator. Each continuation lands mostly on the replica it ran on and finds its context
    there: the gap to `pull` must be a small fraction of the re-prefill the old model charged."""
    cost = load_profile("h200-7b-calibrated")
    replicas = 2
    reqs = rl_longtail(LongtailSpec(prompts=32, samples=8, median=1500, max_tokens=8192, seed=0))
    pull, _ = simulate("pull", reqs, cost, replicas)
    chunked, caches = simulate("chunked", reqs, cost, replicas, chunk_tokens=1024)
    reprefill_s = chunked.reprefill_tokens / cost.prefill_tokens_per_s / replicas  # per replica
    assert reprefill_s > 0.15 * pull.makespan_s  # the old model's charge is large here
    # most continuations find their own context cached
    assert sum(p.seq_hit_tokens for p in caches) >= 0.9 * chunked.reprefill_tokens
    gap = chunked.makespan_s - pull.makespan_s
    assert gap < 0.35 * reprefill_s, (gap, reprefill_s)
    # the same run without own-context caching pays (nearly) the whole re-prefill
    without_own_context_cache(monkeypatch)
    old, old_caches = simulate("chunked", reqs, cost, replicas, chunk_tokens=1024)
    assert sum(p.seq_hits for p in old_caches) == 0
    assert old.makespan_s - pull.makespan_s > 0.8 * reprefill_s
    assert old.makespan_s - chunked.makespan_s > 0.5 * reprefill_s
