"""RouterCore + policies in virtual time over SimEngineCores: no Ray, no vLLM."""
from collections import Counter

import pytest

from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.router.core import NoLiveReplicaError, RouterCore
from rollout_cluster.sim.simulator import Simulation
from rollout_cluster.protocol import (EngineStats, ModelInfo, Report, SamplingSpec, SeqProgress,
                                   SequenceRequest)

from longtail import longtail_requests

COST = load_profile("h200-1.5b", max_num_seqs=32)
POLICIES = ["static", "pull", "least-loaded", "chunked", "steal"]


def simulate(policy, requests, replicas=4, **pc):
    sim = Simulation(make_policy(PolicyConfig(name=policy, **pc), COST), COST, replicas, pull_interval_s=0.05,
                     record_tokens=True)
    return sim, sim.run(requests)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_sequence_returns_once_in_order_with_exact_length(policy):
    reqs = longtail_requests(prompts=12, samples=4, with_ids=True)
    sim, res = simulate(policy, reqs, **({"chunk_tokens": 64} if policy == "chunked" else {}))
    batch = sim.core.batches["sim"]
    assert sorted(batch.order) == list(range(len(reqs)))  # each index finished exactly once
    for i, (req, c) in enumerate(zip(reqs, res.completions)):
        assert (c.index, c.prompt_index, c.sample_index) == (i, req.prompt_index, req.sample_index)
        assert len(c.token_ids) == req.hidden_length, (policy, i)
        assert c.finish_reason == "length"
    assert res.counters["stale_reports"] == 0 and res.counters["policy_errors"] == 0
    assert not sim.core.seqs  # nothing left behind


def test_chunked_cuts_segments_and_reprefills():
    reqs = longtail_requests(prompts=8, samples=2, median=300, with_ids=True)
    sim, res = simulate("chunked", reqs, chunk_tokens=64)
    long_ones = [c for c, r in zip(res.completions, reqs) if r.hidden_length > 64]
    assert long_ones and all(len(c.token_ids) == r.hidden_length for c, r in zip(res.completions, reqs))
    # every segment boundary forces a new attempt: more dispatches than sequences
    assert sim.core.policy.rounds >= max(r.hidden_length for r in reqs) // 64


def test_pull_keeps_groups_together():
    reqs = longtail_requests(prompts=16, samples=4)
    sim, res = simulate("pull", reqs, replicas=4)
    by_group = {}
    for c in res.completions:
        by_group.setdefault(c.prompt_index, set()).add(c.replicas[0])
    together = sum(1 for reps in by_group.values() if len(reps) == 1)
    assert together >= 0.75 * len(by_group)


def test_least_loaded_spreads_groups():
    reqs = longtail_requests(prompts=16, samples=4)
    _, res = simulate("least-loaded", reqs, replicas=4)
    counts = Counter(c.replicas[0] for c in res.completions)
    assert max(counts.values()) - min(counts.values()) <= 1


def test_static_split_is_contiguous_and_even():
    reqs = longtail_requests(prompts=16, samples=4)
    _, res = simulate("static", reqs, replicas=4)
    owners = [c.replicas[0] for c in res.completions]
    assert Counter(owners) == Counter({o: 16 for o in set(owners)})
    changes = sum(1 for a, b in zip(owners, owners[1:]) if a != b)
    assert changes == 3  # four contiguous blocks


def _register(core, rid, now=0.0, capacity=8, model=ModelInfo(100, 64)):
    return core.on_report(Report(rid, "i1", progress=[], stats=EngineStats(), model=model, capacity=capacity), now)


def _core(policy="pull", **pc):
    return RouterCore(make_policy(PolicyConfig(name=policy, **pc), COST), expected_replicas=2, replica_timeout_s=5.0)


def test_submit_without_replica_fails_clearly():
    core = _core()
    with pytest.raises(NoLiveReplicaError, match="no live engine replica"):
        core.submit([SequenceRequest([1, 2], SamplingSpec(), 0, 0)], 0.0)


@pytest.mark.parametrize("prompt, spec, field", [
    ([], SamplingSpec(), "prompt_token_ids"),
    ([1, 100], SamplingSpec(), "prompt_token_ids=100"),
    ([1, -1], SamplingSpec(), "prompt_token_ids=-1"),
    ([1, "a"], SamplingSpec(), "prompt_token_ids='a'"),
    ([1, 2.5], SamplingSpec(), "prompt_token_ids=2.5"),
    ([1] * 64, SamplingSpec(max_tokens=1), "prompt longer than the model's context"),
    ([1, 2], SamplingSpec(max_tokens=0), "max_tokens=0"),
    ([1, 2], SamplingSpec(max_tokens=-3), "max_tokens=-3"),
    ([1, 2], SamplingSpec(max_tokens=63), "max_tokens=63"),
    ([1, 2], SamplingSpec(n=0), "n=0"),
    ([1, 2], SamplingSpec(temperature=-1.0), "temperature=-1.0"),
    ([1, 2], SamplingSpec(top_p=0.0), "top_p=0.0"),
    ([1, 2], SamplingSpec(cache_salt=""), "cache_salt=''"),
    ([1, 2], SamplingSpec(cache_salt=7), "cache_salt=7"),
])
def test_bad_request_errors_name_the_field_and_batch_goes_on(prompt, spec, field):
    core = _core()
    _register(core, "a")
    good = SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=4), 0, 0)
    bad = SequenceRequest(prompt, spec, 1, 0)
    bid = core.submit([good, bad], 0.0)
    done, _, finished = core.fetch(bid, 0)
    assert len(done) == 1 and done[0].finish_reason == "error" and field in done[0].error
    assert not finished
    orders = core.decide("a", 0.1)
    assert [w.seq_id for w in orders.start] == [f"{bid}:0"]
    core.on_report(Report("a", "i1", progress=[SeqProgress(f"{bid}:0", 1, [5, 6, 7, 8], None, "length")],
                          stats=EngineStats(), model=None, capacity=8), 0.2)
    done, _, finished = core.fetch(bid, 0)
    assert finished and [c.index for c in done] == [1, 0] and done[1].token_ids == [5, 6, 7, 8]


def test_give_up_racing_natural_finish_returns_once():
    """Regression: the give-up is ordered in the same interval in which the sequence finishes."""
    core = _core("scripted", scripted_at_tokens=[2])
    _register(core, "a")
    _register(core, "b")
    bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=4), 0, 0)], 0.0)
    work = core.decide("a", 0.0).start[0]
    orders = core.on_report(Report("a", "i1", progress=[SeqProgress(work.seq_id, 1, [7, 8])], stats=EngineStats(),
                                   model=None, capacity=8), 0.1)
    assert orders.give_up == [(work.seq_id, 1)]  # ordered at 2 tokens...
    # ...but the engine finished naturally before it saw the order, then acknowledged nothing.
    core.on_report(Report("a", "i1", progress=[SeqProgress(work.seq_id, 1, [9, 10], None, "length")],
                          stats=EngineStats(), model=None, capacity=8), 0.2)
    # a late abort report of the same attempt must be dropped
    core.on_report(Report("a", "i1", progress=[SeqProgress(work.seq_id, 1, [], None, "abort")],
                          stats=EngineStats(), model=None, capacity=8), 0.3)
    done, _, finished = core.fetch(bid, 0)
    assert finished and len(done) == 1 and done[0].token_ids == [7, 8, 9, 10] and done[0].migrations == []
    assert core.counters.stale_reports == 1 and not core.decide("b", 0.4).start


def test_give_up_continues_elsewhere_with_prompt_plus_partial():
    core = _core("scripted", scripted_at_tokens=[2])
    _register(core, "a")
    _register(core, "b")
    spec = SamplingSpec(max_tokens=5, min_tokens=3, seed=11, logprobs=0)
    bid = core.submit([SequenceRequest([1, 2], spec, 0, 0)], 0.0)
    w1 = core.decide("a", 0.0).start[0]
    core.on_report(Report("a", "i1", progress=[SeqProgress(w1.seq_id, 1, [7, 8], [-0.1, -0.2])],
                          stats=EngineStats(), model=None, capacity=8), 0.1)
    core.on_report(Report("a", "i1", progress=[SeqProgress(w1.seq_id, 1, [9], [-0.3], "abort")],
                          stats=EngineStats(), model=None, capacity=8), 0.2)
    w2 = core.decide("b", 0.3).start[0]
    assert w2.attempt == 2 and w2.prompt_token_ids == [1, 2, 7, 8, 9]
    assert (w2.sampling.max_tokens, w2.sampling.min_tokens, w2.sampling.seed) == (2, 0, 14)
    # a late delta from attempt 1 is dropped
    core.on_report(Report("a", "i1", progress=[SeqProgress(w1.seq_id, 1, [99])], stats=EngineStats(), model=None,
                          capacity=8), 0.35)
    core.on_report(Report("b", "i1", progress=[SeqProgress(w1.seq_id, 2, [10, 11], [-0.4, -0.5], "length")],
                          stats=EngineStats(), model=None, capacity=8), 0.4)
    (c,), _, finished = core.fetch(bid, 0)
    assert finished and c.token_ids == [7, 8, 9, 10, 11] and c.logprobs == [-0.1, -0.2, -0.3, -0.4, -0.5]
    assert c.replicas == ["a", "b"]
    assert [(m.source, m.destination, m.at_token) for m in c.migrations] == [("a", "b", 3)]


def test_continuation_reprefill_counts_what_the_engine_did_not_find_cached():
    """A segment's first report carries vLLM's num_cached_tokens: for a continuation the router
    counts context - cached as re-prefilled; a fresh segment's report counts nothing."""
    core = _core("scripted", scripted_at_tokens=[2])
    _register(core, "a")
    _register(core, "b")
    core.submit([SequenceRequest([1, 2, 3, 4], SamplingSpec(max_tokens=6), 0, 0)], 0.0)
    w1 = core.decide("a", 0.0).start[0]
    core.on_report(Report("a", "i1", progress=[SeqProgress(w1.seq_id, 1, [7, 8], cached_tokens=0)],
                          stats=EngineStats(), model=None, capacity=8), 0.1)
    assert core.counters.reprefilled_tokens == 0  # the first segment is not a re-prefill
    core.on_report(Report("a", "i1", progress=[SeqProgress(w1.seq_id, 1, [9], None, "abort")], stats=EngineStats(),
                          model=None, capacity=8), 0.2)
    w2 = core.decide("b", 0.3).start[0]
    assert w2.prompt_len == 7 and core.counters.reprefill_tokens == 7  # sent: prompt + 3 generated
    core.on_report(Report("b", "i1", progress=[SeqProgress(w1.seq_id, 2, [10], cached_tokens=4)],
                          stats=EngineStats(), model=None, capacity=8), 0.4)
    core.on_report(Report("b", "i1", progress=[SeqProgress(w1.seq_id, 2, [11])], stats=EngineStats(), model=None,
                          capacity=8), 0.5)  # -1: not again
    assert core.counters.reprefilled_tokens == 3 and core.counters.reprefill_segments_measured == 1


def test_dead_replica_work_resumes_from_last_reported_tokens():
    core = _core()
    _register(core, "a")
    _register(core, "b")
    bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=6), 0, j) for j in range(2)], 0.0)
    works = core.decide("a", 0.0).start + core.decide("b", 0.0).start
    wa = next(w for w in works if core.seqs[w.seq_id].replica == "a")
    core.on_report(Report("a", "i1", progress=[SeqProgress(wa.seq_id, 1, [4, 5])], stats=EngineStats(), model=None,
                          capacity=8), 1.0)
    core.on_report(Report("b", "i1", progress=[], stats=EngineStats(), model=None, capacity=8), 6.5)
    assert core.expire(7.0) == ["a"]
    w = core.decide("b", 7.0).start[0]
    assert w.seq_id == wa.seq_id and w.prompt_token_ids == [1, 2, 4, 5] and w.sampling.max_tokens == 4
    # the dead replica comes back with an old report: dropped
    core.on_report(Report("a", "i1", progress=[SeqProgress(wa.seq_id, 1, [6], None, "length")],
                          stats=EngineStats(), model=None, capacity=8), 7.1)
    assert core.counters.stale_reports == 1
    assert [(m.source, m.destination, m.at_token, m.reason) for m in core.seqs[wa.seq_id].migrations] == [
        ("a", "b", 2, "replica_lost")]
    assert core.counters.recovered == 1 and core.counters.migrations == 0


def test_restarted_replica_requeues_its_old_work():
    core = _core()
    _register(core, "a")
    core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=6), 0, 0)], 0.0)
    w = core.decide("a", 0.0).start[0]
    orders = core.on_report(Report("a", "i2", progress=[], stats=EngineStats(), model=None, capacity=8), 1.0)  # new incarnation
    assert [x.seq_id for x in orders.start] == [w.seq_id] and orders.start[0].attempt == 2


def test_pinned_sequences_never_move():
    reqs = longtail_requests(prompts=8, samples=4, with_ids=True)
    for r in reqs:
        r.sampling = SamplingSpec(max_tokens=r.sampling.max_tokens, ignore_eos=True, presence_penalty=0.5)
    _, res = simulate("scripted", reqs, replicas=2, scripted_at_tokens=[4])
    assert res.counters["migrations"] == 0


def test_scripted_migrations_keep_lengths_exact():
    reqs = longtail_requests(prompts=8, samples=2, with_ids=True)
    _, res = simulate("scripted", reqs, replicas=2, scripted_at_tokens=[5, 17, 40])
    assert res.counters["migrations"] > 8
    for r, c in zip(reqs, res.completions):
        assert len(c.token_ids) == r.hidden_length
        assert len(c.migrations) == sum(1 for t in (5, 17, 40) if t < r.hidden_length - 1) or len(c.migrations) <= 3
        assert [m.at_token for m in c.migrations] == sorted(m.at_token for m in c.migrations)


def test_cancel_finishes_queued_at_once_and_running_on_confirmation():
    core = _core()
    _register(core, "a", capacity=1)
    bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=6), 0, j) for j in range(3)], 0.0)
    w = core.decide("a", 0.0).start[0]
    assert core.cancel(bid, 0.1) == 3
    done, _, finished = core.fetch(bid, 0)
    assert len(done) == 2 and all(c.finish_reason == "abort" for c in done) and not finished
    orders = core.decide("a", 0.2)
    assert orders.give_up == [(w.seq_id, 1)] and not orders.start
    core.on_report(Report("a", "i1", progress=[SeqProgress(w.seq_id, 1, [3], None, "abort")], stats=EngineStats(),
                          model=None, capacity=1), 0.3)
    done, _, finished = core.fetch(bid, 0)
    assert finished and done[-1].token_ids == [3] and done[-1].finish_reason == "abort"
    assert not core.decide("a", 0.4).start


@pytest.mark.parametrize("policy, pc, per_replica", [
    ("steal", {"spread_chunk": 1}, 1),  # one sample of a group per replica
    ("steal", {"spread_chunk": 2}, 2),  # two at a time: the group's prompt is prefilled on 4 replicas, not 8
    ("steal", {"spread_chunk": 8}, 8),  # chunk = group size: group-affine placement
    ("pull", {}, 8),
])
def test_steal_spreads_a_group_over_replicas_chunk_at_a_time(policy, pc, per_replica):
    reqs = longtail_requests(prompts=8, samples=8)  # 64 sequences, 8 per replica: all start at t=0
    _, res = simulate(policy, reqs, replicas=8, **pc)
    by_group = {}
    for c in res.completions:
        by_group.setdefault(c.prompt_index, Counter())[c.replicas[0]] += 1
    for g, on in by_group.items():
        assert sorted(on.values()) == [per_replica] * (8 // per_replica), (policy, pc, g, on)


def test_steal_keeps_reprefill_within_budget_at_scale():
    from rollout_cluster.engines.cost_model import load_profile as lp

    cost = lp("a100-80g-7b", max_num_seqs=64)
    reqs = longtail_requests(prompts=64, samples=8, median=1500, sigma_p=0.9, sigma_s=0.5, max_tokens=8192,
                             prompt_range=(256, 1024))
    results = {}
    for name, budget in (("static", None), ("steal", PolicyConfig().max_reprefill_frac), ("steal", 0.02)):
        pc = PolicyConfig(name=name) if budget is None else PolicyConfig(name=name, max_reprefill_frac=budget)
        sim = Simulation(make_policy(pc, cost), cost, 8, pull_interval_s=0.5)
        results[name, budget] = sim.run(reqs)
    tight = results["steal", 0.02]
    for (name, budget), res in results.items():
        if name == "steal":
            assert res.counters["migrations"] > 0
            assert res.counters["reprefill_tokens"] <= budget * res.counters["generated_tokens"] + 20000
    assert tight.counters["reprefill_tokens"] < results["steal", PolicyConfig().max_reprefill_frac].counters[
        "reprefill_tokens"]  # the tight budget binds
    assert results["steal", PolicyConfig().max_reprefill_frac].makespan_s < 0.97 * results["static", None].makespan_s


def test_steal_vectorised_estimate_equals_the_scalar_one():
    """Regression: the steal policy's numpy path must agree with estimate.expected_remaining."""
    from types import SimpleNamespace

    from rollout_cluster.policy.estimate import expected_remaining
    from rollout_cluster.policy.steal import StealPolicy

    from rollout_cluster.router.seq_table import SeqTable

    seqs = [SimpleNamespace(seq_id=f"s{i}", generated=g, max_tokens=m, context_tokens=100 + g, group=None,
                            request=SimpleNamespace(prompt_len=100, sampling=SimpleNamespace(max_tokens=m)))
            for i, (g, m) in enumerate([(0, 50), (10, 50), (49, 50), (300, 4000), (3000, 4000), (5, 16384)])]
    table = SeqTable()
    for s in seqs:
        table[s.seq_id] = s
    view = SimpleNamespace(groups={})
    load = StealPolicy(PolicyConfig(name="steal"), COST)._load(view, SimpleNamespace(seqs=table), typical=200.0)
    assert list(load.rem) == [expected_remaining(s, None, 200.0, use_group=False) for s in seqs]
    assert list(load.ctx) == [s.context_tokens for s in seqs]


def test_long_lived_router_keeps_bounded_statistics():
    """Regression: decision times and finished lengths grew by one entry per pull / sequence forever."""
    from rollout_cluster.router.tracing import append_bounded

    core = _core()
    _register(core, "a", capacity=64)
    for b in range(3):
        bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=3), 0, j) for j in range(40)], float(b))
        works = core.decide("a", float(b), timer=lambda: 0.0).start
        core.on_report(Report("a", "i1",
                              progress=[SeqProgress(w.seq_id, w.attempt, [5, 6, 7], None, "length") for w in works],
                              stats=EngineStats(), model=None, capacity=64), b + 0.5)
        assert core.fetch(bid, 0)[2]
        core.release(bid)
    assert len(core.moves.finished_lengths) == 120
    small = 10
    for i in range(100):
        append_bounded(core.moves.finished_lengths, i, small)
    assert small <= len(core.moves.finished_lengths) <= 2 * small and core.moves.finished_lengths[-1] == 99


def test_step_time_reports_are_kept_only_while_tracing():
    core = _core()
    _register(core, "a")
    core.on_report(Report("a", "i1", progress=[],
                          stats=EngineStats(running=4, context_tokens=900, seq_tokens_per_s=50.0), model=None,
                          capacity=8), 1.0)
    assert core.step_samples == []
    core.trace = []
    core.on_report(Report("a", "i1", progress=[],
                          stats=EngineStats(running=4, context_tokens=900, seq_tokens_per_s=50.0), model=None,
                          capacity=8), 2.0)
    core.on_report(Report("a", "i1", progress=[],
                          stats=EngineStats(running=0, context_tokens=0, seq_tokens_per_s=50.0), model=None,
                          capacity=8), 3.0)
    core.on_report(Report("a", "i1", progress=[],
                          stats=EngineStats(running=3, context_tokens=700, seq_tokens_per_s=0.0), model=None,
                          capacity=8), 4.0)
    assert core.step_samples == [(4, 900, 0.02)]  # idle and unmeasured reports carry no sample


def test_router_keeps_tokens_in_compact_arrays_and_hands_out_lists():
    """The router holds every token of a batch until it is fetched: 4 bytes an id and 8 a logprob
    (arrays), not a Python object each. Drivers still get plain lists."""
    from array import array

    core = _core()
    _register(core, "a")
    bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=4, logprobs=0), 0, 0)], 0.0)
    (w,) = core.decide("a", 0.0).start
    core.on_report(Report("a", "i1",
                          progress=[SeqProgress(w.seq_id, w.attempt, [5, 6], [-0.5, -0.25], None, offset=0)],
                          stats=EngineStats(), model=None, capacity=8), 0.1)
    seq = core.seqs[w.seq_id]
    assert isinstance(seq.token_ids, array) and seq.token_ids.itemsize == 4
    assert isinstance(seq.logprobs, array) and seq.logprobs.typecode == "d"
    core.on_report(Report("a", "i1",
                          progress=[SeqProgress(w.seq_id, w.attempt, [7, 8], [-1.0, -2.0], "length", offset=2)],
                          stats=EngineStats(), model=None, capacity=8), 0.2)
    assert isinstance(core.batches[bid].results[0].token_ids, array)
    done, _, finished = core.fetch(bid, 0)
    assert finished and type(done[0].token_ids) is list and type(done[0].logprobs) is list
    assert done[0].token_ids == [5, 6, 7, 8] and done[0].logprobs == [-0.5, -0.25, -1.0, -2.0]
