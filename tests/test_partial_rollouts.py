"""Partial rollouts (resume.py): a batch cut at finish_fraction hands its unfinished samples back
with their tokens, and a later batch continues them after those tokens, as after a migration."""
import asyncio
import json

import pytest

from rollout_cluster.bench.workloads import LongtailSpec
from rollout_cluster.client.expand import expand
from rollout_cluster.client.follower import BatchFollower
from rollout_cluster.client.jsonl import merge_results, read_requests
from rollout_cluster.client.loops import follow_batch
from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.serve.metrics import PrometheusRouterMetrics
from rollout_cluster.policy import make_policy
from rollout_cluster.router.core import RouterCore
from rollout_cluster.sim.simulator import Simulation
from rollout_cluster.protocol import (Completion, EngineStats, InputError, ModelInfo, Partial, Report, SamplingSpec,
                                   SeqProgress, SequenceRequest, partials)

from longtail import longtail_requests
from test_router_adoption import PROMPT, finish, new_router, orphan_handed_over, report, whole
from test_router_core import simulate
from test_router_restart import FakeRouter, client_over

SPEC = SamplingSpec(max_tokens=6, logprobs=0)


def resumed(output, logprobs, spec=SPEC, prompt=PROMPT, index=0) -> SequenceRequest:
    return SequenceRequest(list(prompt), spec, index, 0, output_token_ids=output, output_logprobs=logprobs)


def test_a_resumed_sample_continues_after_its_output_and_comes_back_whole():
    core = new_router()
    bid = core.submit([resumed([7, 8, 9], [-0.1, -0.2, -0.3])], 1.0)
    (work,) = finish(core, 1.0, extra=3)
    # the first segment is a continuation: prompt + output, what is left of max_tokens, the prior logprobs
    assert work.prompt_token_ids == PROMPT + [7, 8, 9] and work.sampling.max_tokens == 3
    assert list(work.prior_logprobs) == [-0.1, -0.2, -0.3] and work.prefix_len == len(PROMPT)
    (c,), _, done = core.fetch(bid, 0)
    assert done and c.finish_reason == "length" and c.resumed_tokens == 3
    assert list(c.token_ids) == [7, 8, 9, 9, 9, 9]
    assert list(c.logprobs) == [-0.1, -0.2, -0.3, -0.5, -0.5, -0.5]
    assert not c.migrations  # resuming is not a move
    assert core.counters.partials_resumed == 1 and core.counters.partial_tokens_resumed == 3


def test_bad_resumed_outputs_fail_naming_the_field_and_the_rest_of_the_batch_runs():
    pinned = SamplingSpec(max_tokens=6, presence_penalty=0.5)
    bad = [
        (resumed("x", None), "output_token_ids='x'"),
        (resumed([7, "y"], [0.0, 0.0]), "output_token_ids='y'"),
        (resumed([7, 5000], [0.0, 0.0]), "output_token_ids=5000: token id outside the vocabulary"),
        (resumed([1] * 6, [0.0] * 6), "output_token_ids='<6 tokens>': nothing left to generate"),
        (resumed([7], [0.0], spec=pinned), "output_token_ids='<1 tokens>': cannot resume"),
        (resumed([7, 8], None), "output_logprobs=None: sampling asks for logprobs"),
        (resumed([7, 8], [0.0]), "output_logprobs='<1 logprobs>'"),
        (resumed([7, 8], [0.0, "z"]), "output_logprobs='z'"),
        (resumed(None, [0.0]), "output_logprobs=[0.0]: given without output_token_ids"),
        (resumed([7], [0.0], spec=SamplingSpec(max_tokens=6)), "output_logprobs='<1>': given, but sampling.logprobs is null"),
    ]
    core = new_router()
    good = resumed([7, 8], [-1.0, -1.0], index=len(bad))
    bid = core.submit([r for r, _ in bad] + [good], 1.0)
    finish(core, 1.0, extra=4)
    results, _, done = core.fetch(bid, 0)
    by_index = {c.index: c for c in results}
    assert done and len(by_index) == len(bad) + 1
    for i, (_, message) in enumerate(bad):
        assert by_index[i].finish_reason == "error" and by_index[i].error.startswith(message), by_index[i].error
        assert by_index[i].resumed_tokens == 0
    ok = by_index[len(bad)]
    assert ok.finish_reason == "length" and list(ok.token_ids) == [7, 8, 9, 9, 9, 9] and ok.resumed_tokens == 2


def test_a_resumed_sample_is_taken_over_after_a_router_restart():
    core = new_router()
    # the old router ran its continuation: prompt + the resumed output, then 2 more tokens
    orphan_handed_over(core, SeqProgress("r1-b0:0", 1, [20, 21], [-2.0, -2.0], "abort", offset=0,
                                         prompt_token_ids=PROMPT + [7, 8], prior_logprobs=[-1.0, -1.0]))
    bid = core.submit([resumed([7, 8], [-1.0, -1.0])], 2.0, previous_ids=["r1-b0:0"])
    (work,) = finish(core, 2.1, extra=2)
    assert work.prompt_token_ids == PROMPT + [7, 8, 20, 21] and work.sampling.max_tokens == 2
    (c,), _, _ = core.fetch(bid, 0)
    assert list(c.token_ids) == [7, 8, 20, 21, 9, 9] and c.resumed_tokens == 2
    assert list(c.logprobs) == [-1.0, -1.0, -2.0, -2.0, -0.5, -0.5]
    assert core.counters.adopted == 1


def test_an_orphan_that_did_not_start_from_the_resumed_output_is_not_taken():
    core = new_router()
    orphan_handed_over(core, whole("r1-b0:0", [20, 21], [-2.0, -2.0], prompt=PROMPT + [6, 6]))
    bid = core.submit([resumed([7, 8], [-1.0, -1.0])], 2.0, previous_ids=["r1-b0:0"])
    (work,) = finish(core, 2.1, extra=4)
    assert work.prompt_token_ids == PROMPT + [7, 8] and core.counters.adopted == 0
    (c,), _, _ = core.fetch(bid, 0)
    assert list(c.token_ids) == [7, 8, 9, 9, 9, 9]


class CuttingRouter(FakeRouter):
    """FakeRouter whose replica also obeys give-ups: a sequence given up reports 2 tokens and
    ends "abort". It records every Work it started."""

    def restart(self, weights=(0, "")):
        super().restart(weights)
        self.started = []

    def _fetch(self, batch_id, cursor, wait_s):
        orders = self.core.decide("a", self.now)
        self.started += orders.start
        self.running += orders.start
        gone = {sid for sid, _ in orders.give_up}
        cut = [w for w in self.running if w.seq_id in gone]
        self.running = [w for w in self.running if w.seq_id not in gone]
        done, self.running = self.running[:self.per_fetch], self.running[self.per_fetch:]
        self.report([SeqProgress(w.seq_id, w.attempt, list(range(w.sampling.max_tokens)), [-0.5] * w.sampling.max_tokens,
                                 "length", offset=0) for w in done]
                    + [SeqProgress(w.seq_id, w.attempt, [1, 2], [-0.25, -0.25], "abort", offset=0) for w in cut])
        new, cursor, finished = self.core.fetch(batch_id, cursor, self.now)
        if finished:
            self.core.release(batch_id)
        return new, cursor, finished


PROMPTS = [[5, 6 + i] for i in range(10)]
LONG = SamplingSpec(max_tokens=8, logprobs=0)


def test_generate_cuts_at_finish_fraction_and_the_partials_finish_in_the_next_batch():
    router = CuttingRouter(per_fetch=3)
    client = client_over(router)
    first = client.generate(PROMPTS, LONG, finish_fraction=0.5)
    assert [c.index for c in first] == list(range(10))  # every sequence once, in place
    ended = [c for c in first if c.finish_reason == "length"]
    cut = [c for c in first if c.finish_reason == "abort"]
    assert len(ended) == 6 and len(cut) == 4  # cut after the fetch that reached 5 of 10
    assert all(c.token_ids == [1, 2] and c.logprobs == [-0.25, -0.25] for c in cut)
    carry = partials(PROMPTS, first)
    assert [p.prompt_token_ids for p in carry] == [PROMPTS[c.prompt_index] for c in cut]
    # the next step: the carried samples beside a fresh prompt; the partials go first
    second = client.generate(carry + [[5, 99]], LONG)
    assert [c.finish_reason for c in second] == ["length"] * 5
    for p, c in zip(carry, second):
        assert c.resumed_tokens == 2 and len(c.token_ids) == LONG.max_tokens
        assert c.token_ids == [1, 2] + list(range(LONG.max_tokens - 2))
        assert c.logprobs == [-0.25, -0.25] + [-0.5] * (LONG.max_tokens - 2)
    continued = [w for w in router.started if w.prompt_token_ids[-2:] == [1, 2]]
    assert [w.prompt_token_ids for w in continued] == [p.prompt_token_ids + [1, 2] for p in carry]
    assert second[-1].resumed_tokens == 0 and second[-1].token_ids == list(range(LONG.max_tokens))


def test_without_finish_fraction_nothing_is_cut_and_a_full_fraction_cuts_nothing():
    for fraction in (None, 1.0):
        results = client_over(CuttingRouter(per_fetch=3)).generate(PROMPTS, LONG, finish_fraction=fraction)
        assert all(c.finish_reason == "length" and len(c.token_ids) == 8 for c in results)


def test_stream_cuts_too():
    router = CuttingRouter(per_fetch=4)

    async def collect():
        return [c async for c in follow_batch(router, expand(PROMPTS, LONG), 60.0, 5.0, finish_fraction=0.3)]

    got = asyncio.run(collect())
    assert sorted(c.index for c in got) == list(range(10))
    assert sum(c.finish_reason == "abort" for c in got) == 6  # cut after the first fetch (4 of 10)


def _done(index: int):
    return Completion(index, 0, [1], None, "length", index=index)


def test_a_cut_batch_resubmitted_after_a_router_restart_is_cut_again():
    follow = BatchFollower(expand(PROMPTS, LONG), finish_fraction=0.5)
    follow.submitted({"batch_id": "r1-b0", "weights_version": 0})
    follow.take([_done(i) for i in range(4)], 4)
    assert not follow.should_cut()
    follow.take([_done(4)], 5)
    assert follow.should_cut()
    follow.cut = True
    assert not follow.should_cut()
    follow.submitted({"batch_id": "r2-b0", "weights_version": 0}, now=3.0)
    assert follow.should_cut()


@pytest.mark.parametrize("bad", [0, 1.5, -0.1, "0.5", True])
def test_finish_fraction_out_of_range_is_refused_naming_it(bad):
    with pytest.raises(InputError, match=r"^finish_fraction="):
        client_over(CuttingRouter()).generate(PROMPTS, LONG, finish_fraction=bad)


def test_a_partial_is_one_sample_and_one_cut_before_its_first_token_starts_afresh():
    reqs = expand([Partial([5, 6], [7, 8], [-1.0, -1.0]), Partial([5, 6], []), [9, 9]], SamplingSpec(n=2, logprobs=0))
    assert [(r.prompt_index, r.sample_index) for r in reqs] == [(0, 0), (1, 0), (2, 0), (2, 1)]
    assert reqs[0].output_token_ids == [7, 8] and reqs[0].output_logprobs == [-1.0, -1.0]
    assert reqs[1].output_token_ids is None and reqs[1].output_logprobs is None
    assert reqs[2].output_token_ids is None


def test_partials_of_a_resumed_batch_keep_the_original_prompt():
    prompts = [Partial([5, 6], [7]), [9, 9]]
    done = [Completion(0, 0, [7, 8, 1], None, "abort"), Completion(1, 0, [3], None, "length")]
    (p,) = partials(prompts, done)
    assert p.prompt_token_ids == [5, 6] and p.token_ids == [7, 8, 1] and p.logprobs is None


def test_jsonl_lines_resume_output_and_an_abort_line_feeds_the_next_batch():
    out_line = {"prompt_token_ids": [5, 6], "output_token_ids": [7, 8], "output_logprobs": [-1.0, -1.0],
                "logprobs": 0, "max_tokens": 6}
    lines = [json.dumps(out_line), json.dumps(dict(out_line, n=2)), json.dumps({"prompt_token_ids": [5], "n": 2})]
    reqs, errors = read_requests(lines)
    assert [(r.prompt_index, r.sample_index) for r in reqs] == [(0, 0), (2, 0), (2, 1)]
    assert reqs[0].output_token_ids == [7, 8] and reqs[0].output_logprobs == [-1.0, -1.0]
    assert errors[1].startswith("n=2: must be 1 on a line that resumes output_token_ids")
    core = new_router()
    bid = core.submit(reqs, 1.0)
    finish(core, 1.0, extra=4)
    results, _, _ = core.fetch(bid, 0)
    records = merge_results(len(lines), reqs, sorted(results, key=lambda c: c.index), errors)
    assert records[0]["token_ids"] == [7, 8, 9, 9, 9, 9] and records[0]["resumed_tokens"] == 2
    assert records[1]["finish_reason"] == "error" and records[3]["resumed_tokens"] == 0


def test_steal_spreads_a_batchs_resumed_samples_over_the_replicas():
    """Resumed samples are continuations, taken before fresh work; the first replica to pull
    takes only its even share of them, not every one its slots hold."""
    core = RouterCore(make_policy(PolicyConfig(name="steal"), load_profile("h200-1.5b", max_num_seqs=64)),
                      id_prefix="r1-")
    replicas = ["a", "b", "c", "d"]
    for rid in replicas:
        core.on_report(Report(rid, "i1", progress=[], stats=EngineStats(), model=ModelInfo(1000, 4096), capacity=64), 0.0)
    carried = [resumed([7] * 3, [-1.0] * 3, spec=SamplingSpec(max_tokens=100, logprobs=0), index=i) for i in range(32)]
    fresh = [SequenceRequest([5, 6], SamplingSpec(max_tokens=100, logprobs=0), 32 + i, 0) for i in range(32)]
    core.submit(carried + fresh, 0.1)
    taken = {rid: core.on_report(Report(rid, "i1", progress=[], stats=EngineStats(), model=None, capacity=64), 0.2).start for rid in replicas}
    resumed_on = {rid: sum(1 for w in work if w.prompt_len > 2) for rid, work in taken.items()}
    assert resumed_on == {"a": 8, "b": 8, "c": 8, "d": 8}, resumed_on
    assert sum(len(w) for w in taken.values()) == 64


def test_the_simulator_cuts_a_batch_and_counts_what_each_sample_made():
    reqs = longtail_requests(prompts=12, samples=4)
    _, uncut = simulate("steal", reqs)
    assert uncut.generated == [r.hidden_length for r in reqs] and uncut.cut_s == -1.0

    cost = load_profile("h200-1.5b", max_num_seqs=32)
    sim = Simulation(make_policy(PolicyConfig(name="steal"), cost), cost, 4, pull_interval_s=0.05)
    res = sim.run(reqs, cut_after=24)
    reasons = [c.finish_reason for c in res.completions]
    assert reasons.count("length") >= 24 and "abort" in reasons
    assert 0 < res.cut_s < res.makespan_s < uncut.makespan_s
    for r, c, n in zip(reqs, res.completions, res.generated):
        if c.finish_reason == "length":
            assert n == r.hidden_length
        else:
            assert 0 <= n < r.hidden_length


def test_partial_rollout_steps_complete_more_samples_a_second_and_carry_the_rest(partial_rollouts_sim):
    spec = LongtailSpec(prompts=16, samples=8, median=300, max_tokens=4096, prompt_min=32, prompt_max=128)
    rows = []
    for f in (1.0, 0.9):
        rows += partial_rollouts_sim.run_steps(f, 3, spec, "h200-1.5b", 4, "steal", pull_interval_s=0.1)
    waiting = [r for r in rows if r["fraction"] == 1.0]
    cutting = [r for r in rows if r["fraction"] == 0.9]
    assert all(r["completed"] == r["batch"] == 128 and r["carried_on"] == 0 for r in waiting)
    assert cutting[0]["carried_on"] > 0 and cutting[0]["completed"] + cutting[0]["carried_on"] == 128
    # a step's batch is what the step before carried plus a fresh one
    assert [r["batch"] for r in cutting[1:]] == [128 + r["carried_on"] for r in cutting[:-1]]
    assert any(r["completed_from_earlier_steps"] > 0 for r in cutting[1:])
    summ = partial_rollouts_sim.summary(rows)
    assert summ[0.9]["samples_per_s"] > summ[1.0]["samples_per_s"]
    assert summ[1.0]["off_policy_pct"] == 0 and summ[0.9]["off_policy_pct"] > 0
    assert "| 0.9 |" in partial_rollouts_sim.markdown(summ)


def test_resumed_samples_are_counted_in_prometheus():
    metrics = PrometheusRouterMetrics(port=0)
    core = RouterCore(make_policy(PolicyConfig(name="pull"), load_profile("h200-1.5b")), id_prefix="r2-",
                      metrics=metrics)
    core.on_report(report(), 0.0)
    core.submit([resumed([7, 8], [-1.0, -1.0]), resumed([7], [-1.0], index=1), resumed(None, None, index=2)], 1.0)
    assert metrics.registry.get_sample_value("rollout_sequences_resumed_total",
                                             {"source": "-", "reason": "partial"}) == 2


def test_finish_by_group_cuts_once_that_share_of_prompts_came_back_whole():
    reqs = expand([[5, 6], [5, 7], [5, 8], [5, 9]], SamplingSpec(n=3))  # 4 groups of 3
    follow = BatchFollower(reqs, finish_fraction=0.5, finish_by="group")
    follow.submitted({"batch_id": "r1-b0", "weights_version": 0})
    # one sample of every group, then two more of group 0: 6 samples, 1 group whole
    follow.take([_done(i) for i in (0, 3, 6, 9, 1, 2)], 6)
    assert follow.received == 6 and not follow.should_cut()
    follow.take([_done(i) for i in (4, 5)], 8)  # group 1 whole: 2 of 4
    assert follow.should_cut()


def test_generate_by_group_returns_whole_groups_and_cuts_the_rest():
    router = CuttingRouter(per_fetch=3)
    prompts = [[5, 6 + i] for i in range(4)]
    results = client_over(router).generate(prompts, SamplingSpec(n=3, max_tokens=8, logprobs=0), finish_fraction=0.5,
                                           finish_by="group")
    by_group = {}
    for c in results:
        by_group.setdefault(c.prompt_index, []).append(c.finish_reason)
    complete = [g for g, reasons in by_group.items() if reasons == ["length"] * 3]
    assert len(complete) >= 2 and any("abort" in reasons for reasons in by_group.values()), by_group


@pytest.mark.parametrize("by", ["samples", "prompt", None])
def test_finish_by_must_be_sample_or_group(by):
    with pytest.raises(InputError, match=r"^finish_by="):
        client_over(CuttingRouter()).generate(PROMPTS, LONG, finish_fraction=0.5, finish_by=by)


def _post(gateway, query: str, body: bytes):
    from types import SimpleNamespace

    answer = gateway.post(f"/generate?{query}", content=body)
    return SimpleNamespace(status_code=answer.status_code, body=answer.content)


def test_the_http_route_cuts_at_finish_fraction_and_refuses_bad_values_naming_them():
    from starlette.testclient import TestClient

    from rollout_cluster.serve.gateway import gateway_app

    gateway = TestClient(gateway_app(CuttingRouter(per_fetch=3), {}, 5.0))
    body = "".join(json.dumps({"prompt_token_ids": p, "max_tokens": 8, "logprobs": 0}) + "\n" for p in PROMPTS).encode()
    answer = _post(gateway, "finish_fraction=0.5", body)
    lines = [json.loads(x) for x in answer.body.decode().splitlines()]
    assert answer.status_code == 200 and len(lines) == 10
    assert [o["finish_reason"] for o in lines].count("abort") == 4
    for query, said in [("finish_fraction=1.5", "finish_fraction=1.5: must be"),
                        ("finish_fraction=most", "finish_fraction='most': must be"),
                        ("finish_fraction=0.5&finish_by=prompt", "finish_by='prompt': must be one of sample, group")]:
        answer = _post(gateway, query, body)
        assert answer.status_code == 400 and said in json.loads(answer.body)["error"], query


def test_the_http_routes_answer_bad_queries_and_methods_naming_them_and_serve_their_openapi_page():
    """The Gateway is FastAPI's: typed query parameters, yet the 400 and 405 texts of before."""
    from starlette.testclient import TestClient

    from rollout_cluster.serve.gateway import gateway_app

    gateway = TestClient(gateway_app(CuttingRouter(per_fetch=3), {}, 5.0))
    body = json.dumps({"prompt_token_ids": [5, 6], "max_tokens": 8}).encode()
    for query, said in [("timeout_s=soon", "timeout_s='soon': not a number"),
                        ("weights_version=v1", "weights_version='v1': must be an integer >= 0"),
                        ("weights_version=-1", "weights_version='-1': must be an integer >= 0")]:
        answer = _post(gateway, query, body)
        assert answer.status_code == 400 and json.loads(answer.body)["error"] == said, query
    answer = gateway.get("/generate")
    assert answer.status_code == 405 and "GET /generate: use GET / for status" in answer.json()["error"]
    assert {"/", "/generate"} <= set(gateway.get("/openapi.json").json()["paths"])
    assert gateway.get("/docs").status_code == 200


def test_a_stream_closed_before_its_end_cancels_the_batch():
    """RolloutClient.stream's loop (client/loops.run_async): a driver that stops reading (breaks out,
    or its task is cancelled) cancels the batch instead of leaving it to router.abandoned_batch_s."""
    router = CuttingRouter(per_fetch=2)
    cancelled = []
    router.cancel = type(router.cancel)(lambda bid: (cancelled.append(bid), router._cancel(bid))[1])

    async def first_then_leave():
        stream = follow_batch(router, expand(PROMPTS, LONG), 60.0, 5.0)
        first = await stream.__anext__()
        await stream.aclose()
        await asyncio.sleep(0.05)  # the cancel is not waited for
        return first

    asyncio.run(first_then_leave())
    assert cancelled == list(router.core.batches)
    assert router.core.seqs == {} or all(s.cancelled for s in router.core.seqs.values())
