"""A restarted router takes over what its predecessor's segments generated (router/adoption.py).

The replicas still run the old router's segments after it died. The new router gives them up as
orphans and asks for their whole output; a driver's resubmission names each sequence's old id,
and the sequence continues from that output instead of from its prompt. Taken only when exact,
and once."""
import asyncio

import pytest

from rollout_cluster.router import adoption as router_adoption
from rollout_cluster.config import EngineConfig, PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.engines.vllm_engine import VllmEngine
from rollout_cluster.policy import make_policy
from rollout_cluster.router.core import RouterCore
from rollout_cluster.protocol import (EngineStats, InputError, Listing, ModelInfo, Report, SamplingSpec,
                                      SeqProgress, SequenceRequest, WeightsState, Work)

COST = load_profile("h200-1.5b", max_num_seqs=4)
PROMPT = [5, 6, 7]


def report(progress=(), held=None, capacity=4, version=0, path="") -> Report:
    return Report("a", "i1", progress=list(progress), stats=EngineStats(), model=ModelInfo(1000, 4096),
                  capacity=capacity, weights=WeightsState(version=version, path=path),
                  listing=None if held is None else Listing(held, []))


def new_router() -> RouterCore:
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), id_prefix="r2-")
    core.on_report(report(), 0.0)
    return core


def whole(old_id: str, tokens, logprobs=None, reason="abort", prompt=PROMPT) -> SeqProgress:
    return SeqProgress(old_id, 1, list(tokens), logprobs, reason, offset=0, prompt_token_ids=list(prompt))


def orphan_handed_over(core: RouterCore, out: SeqProgress, now: float = 1.0):
    """The replica lists the old attempt twice; the router gives it up asking for its whole output,
    which the replica's next report carries. Returns the orders answering that report."""
    key = (out.seq_id, out.attempt)
    core.on_report(report(held=[key]), now)
    orders = core.on_report(report(held=[key]), now + 0.1)
    assert key in orders.give_up and key in orders.report_whole
    return core.on_report(report([out], held=[]), now + 0.2)


def request(max_tokens=10, logprobs=0, prompt=PROMPT, index=0) -> SequenceRequest:
    return SequenceRequest(list(prompt), SamplingSpec(max_tokens=max_tokens, logprobs=logprobs), index, 0)


def finish(core: RouterCore, now: float, extra: int, work=None) -> list:
    """Run what is queued on replica a (or `work`, started already): each segment makes `extra`
    more tokens (logprob -0.5)."""
    work = core.decide("a", now).start if work is None else work
    core.on_report(report([SeqProgress(w.seq_id, w.attempt, [9] * extra, [-0.5] * extra, "length", offset=0)
                           for w in work], held=[]), now + 0.1)
    return work


def test_an_orphans_output_is_taken_over_by_its_resubmission_and_continued():
    core = new_router()
    orphan_handed_over(core, whole("r1-b0:3", [11, 12, 13, 14], [-1.0, -2.0, -3.0, -4.0]))
    assert "r1-b0:3" in core.adoption.orphan_outputs
    bid = core.submit([request(max_tokens=10)], 2.0, previous_ids=["r1-b0:3"])
    (work,) = finish(core, 2.1, extra=6)
    # the continuation: prompt + the taken-over tokens, with what is left of max_tokens
    assert work.prompt_token_ids == PROMPT + [11, 12, 13, 14] and work.sampling.max_tokens == 6
    (c,), _, done = core.fetch(bid, 0)
    assert done and list(c.token_ids) == [11, 12, 13, 14] + [9] * 6
    assert list(c.logprobs) == [-1.0, -2.0, -3.0, -4.0] + [-0.5] * 6
    assert [(m.reason, m.at_token, m.destination) for m in c.migrations] == [("router_restart", 4, "a")]
    assert core.counters.adopted == 1 and core.counters.adopted_tokens == 4 and not core.adoption.orphan_outputs


def test_a_resubmission_that_comes_first_waits_for_the_output_and_takes_it():
    core = new_router()
    bid = core.submit([request(max_tokens=8)], 1.0, previous_ids=["r1-b0:0"])
    assert "r1-b0:0" in core.adoption.awaiting_orphans
    assert not core.decide("a", 1.1).start  # free slots, but its old segment may still be running
    started = orphan_handed_over(core, whole("r1-b0:0", [21, 22], [-1.0, -1.0]), now=1.5).start
    (work,) = finish(core, 2.0, extra=6, work=started)  # it started as soon as its output came
    assert work.prompt_token_ids == PROMPT + [21, 22]
    (c,), _, _ = core.fetch(bid, 0)
    assert list(c.token_ids) == [21, 22] + [9] * 6 and c.migrations[0].reason == "router_restart"


def test_a_resubmission_whose_output_never_comes_starts_from_its_prompt_after_a_while():
    core = new_router()
    bid = core.submit([request(max_tokens=8), request(index=1)], 1.0, previous_ids=["r1-b0:0", None])
    (first,) = core.decide("a", 1.1).start  # the one without an old id runs at once
    assert first.seq_id == f"{bid}:1"
    core.expire(1.0 + router_adoption.ADOPT_WAIT_S - 0.5)
    assert not core.decide("a", 1.2).start
    core.expire(1.0 + router_adoption.ADOPT_WAIT_S)
    (late,) = core.decide("a", 11.1).start
    assert late.seq_id == f"{bid}:0" and late.prompt_token_ids == PROMPT and not core.adoption.awaiting_orphans
    bid2 = core.submit([request()], 11.5, previous_ids=["r1-b0:9"])
    core.cancel(bid2, 11.6)  # a cancel reaches a waiting sequence too
    (c,), _, done = core.fetch(bid2, 0)
    assert done and c.finish_reason == "abort"


def test_an_orphan_that_had_ended_finishes_its_sequence_at_once():
    core = new_router()
    orphan_handed_over(core, whole("r1-b0:1", [31, 32, 2], [-1.0] * 3, reason="stop"))
    orphan_handed_over(core, whole("r1-b0:2", [41] * 5, [-1.0] * 5, reason="length"), now=1.5)
    bid = core.submit([request(max_tokens=10), request(max_tokens=5, index=1)], 2.0,
                      previous_ids=["r1-b0:1", "r1-b0:2"])
    out, _, done = core.fetch(bid, 0)
    assert done and not core.queue
    assert sorted((c.index, c.finish_reason, len(c.token_ids)) for c in out) == [(0, "stop", 3), (1, "length", 5)]
    assert all(c.replicas == ["a"] for c in out)


def test_a_length_end_short_of_the_cap_was_the_old_routers_cut_and_continues():
    core = new_router()
    orphan_handed_over(core, whole("r1-b0:4", [1] * 4, [-1.0] * 4, reason="length"))  # a 4-token chunk
    bid = core.submit([request(max_tokens=10)], 2.0, previous_ids=["r1-b0:4"])
    assert core.seqs[f"{bid}:0"].generated == 4 and len(core.queue) == 1


@pytest.mark.parametrize("case", ["other prompt", "other weights", "logprobs missing", "earlier segments' logprobs missing",
                                  "longer than max_tokens"])
def test_an_output_that_is_not_exactly_this_sequence_is_not_taken(case):
    core = new_router()
    out = whole("r1-b0:5", [1, 2, 3], [-1.0] * 3)
    req = request(max_tokens=10)
    if case == "other prompt":
        out = whole("r1-b0:5", [1, 2, 3], [-1.0] * 3, prompt=[8, 8, 8])
    elif case == "logprobs missing":
        out = whole("r1-b0:5", [1, 2, 3], None)
    elif case == "earlier segments' logprobs missing":  # a continuation whose Work did not carry them
        out = whole("r1-b0:5", [1, 2, 3], [-1.0] * 3, prompt=PROMPT + [4, 4])
    elif case == "longer than max_tokens":
        req = request(max_tokens=2)
    orphan_handed_over(core, out)
    if case == "other weights":
        core.update_weights("/ckpt/step-1", 1)
        core.on_report(report(version=1, path="/ckpt/step-1"), 1.8)
    bid = core.submit([req], 2.0, previous_ids=["r1-b0:5"])
    seq = core.seqs[f"{bid}:0"]
    assert seq.generated == 0 and not seq.migrations and core.counters.adopted == 0  # from its prompt


def test_earlier_segments_are_taken_over_with_the_logprobs_their_work_carried():
    core = new_router()
    out = whole("r1-b0:6", [3, 3], [-0.3, -0.4], prompt=PROMPT + [4, 4])
    out.prior_logprobs = [-0.1, -0.2]  # Work.prior_logprobs, sent back in the whole final
    out.weight_versions = [(0, 0)]  # Work.weight_versions: the earlier segments' too
    orphan_handed_over(core, out)
    bid = core.submit([request(max_tokens=10, logprobs=0)], 2.0, previous_ids=["r1-b0:6"])
    seq = core.seqs[f"{bid}:0"]
    assert seq.token_ids.tolist() == [4, 4, 3, 3] and seq.logprobs.tolist() == [-0.1, -0.2, -0.3, -0.4]
    (w,) = core.decide("a", 2.1).start  # it continues, and its Work carries every logprob so far
    assert w.prompt_token_ids == PROMPT + [4, 4, 3, 3] and list(w.prior_logprobs) == [-0.1, -0.2, -0.3, -0.4]


def test_earlier_segments_are_taken_over_when_no_logprobs_are_asked():
    core = new_router()
    out = whole("r1-b0:6", [3, 3], None, prompt=PROMPT + [4, 4])
    out.weight_versions = [(0, 0)]
    orphan_handed_over(core, out)
    bid = core.submit([request(max_tokens=10, logprobs=None)], 2.0, previous_ids=["r1-b0:6"])
    assert core.seqs[f"{bid}:0"].token_ids.tolist() == [4, 4, 3, 3]


def test_an_output_is_taken_once_and_kept_only_for_a_while(monkeypatch):
    core = new_router()
    orphan_handed_over(core, whole("r1-b0:7", [1, 2], [-1.0, -1.0]))
    first = core.submit([request()], 2.0, previous_ids=["r1-b0:7"])
    again = core.submit([request()], 2.1, previous_ids=["r1-b0:7"])
    assert core.seqs[f"{first}:0"].generated == 2 and core.seqs[f"{again}:0"].generated == 0
    with pytest.raises(InputError, match=r"previous_ids=.*must be a list of 1 ids"):
        core.submit([request()], 2.5, previous_ids=["x", "y"])
    orphan_handed_over(core, whole("r1-b0:8", [1], [-1.0]), now=3.0)
    core.expire(3.0 + router_adoption.ORPHAN_KEEP_S + 1)
    assert not core.adoption.orphan_outputs


class Out:
    def __init__(self, toks, finished=False, reason=None):
        lps = [{t: type("L", (), {"logprob": -0.25})()} for t in toks]
        self.outputs = [type("O", (), {"token_ids": toks, "finish_reason": reason, "logprobs": lps})()]
        self.finished = finished


class SlowAsyncLLM:
    """Streams one token every 10 ms until aborted."""

    errored = False

    def __init__(self):
        self.aborted = set()

    async def generate(self, prompt, params, request_id):
        for t in range(100):
            if request_id in self.aborted:
                yield Out([], finished=True, reason="abort")
                return
            yield Out([100 + t])
            await asyncio.sleep(0.01)

    async def abort(self, ids):
        self.aborted.update(ids)


def test_the_vllm_adapter_reports_the_whole_output_of_an_attempt_given_up_that_way():
    async def go():
        eng = VllmEngine(EngineConfig(), "m", on_cpu=True)
        eng.engine = SlowAsyncLLM()
        eng.submit(Work("r1-b0:0", 1, [5, 6, 4], SamplingSpec(max_tokens=100, logprobs=0)))
        eng.submit(Work("r1-b0:1", 1, [5, 6], SamplingSpec(max_tokens=100)))
        await asyncio.sleep(0.1)
        deltas = eng.drain()
        eng.report_whole([("r1-b0:0", 1)])
        await eng.give_up([("r1-b0:0", 1), ("r1-b0:1", 1)])
        await asyncio.gather(*eng.seqs.tasks.values())
        return deltas, eng.drain()

    deltas, finals = asyncio.run(go())
    streamed = [t for p in deltas if p.seq_id == "r1-b0:0" for t in p.token_ids]
    (w,) = [p for p in finals if p.seq_id == "r1-b0:0" and p.finish_reason]
    (d,) = [p for p in finals if p.seq_id == "r1-b0:1" and p.finish_reason]
    assert w.offset == 0 and w.prompt_token_ids == [5, 6, 4] and w.finish_reason == "abort"
    assert w.token_ids[:len(streamed)] == streamed and len(w.token_ids) >= len(streamed) > 0
    assert w.logprobs == [-0.25] * len(w.token_ids)
    assert d.offset > 0 and d.prompt_token_ids is None  # not asked: its final report is a delta


def test_a_resubmission_waits_only_while_its_old_segment_may_still_run():
    core = new_router()
    core.on_report(report(held=[("r1-b0:1", 1)]), 0.5)  # every replica has listed: r1-b0:1 runs, r1-b0:0 not
    bid = core.submit([request(), request(index=1)], 1.0, previous_ids=["r1-b0:0", "r1-b0:1"])
    (started,) = core.decide("a", 1.1).start
    assert started.seq_id == f"{bid}:0" and list(core.adoption.awaiting_orphans) == ["r1-b0:1"]
    # r1-b0:1 ends on its own before its give-up: a delta, its earlier tokens went with the old
    # router. The router asks for it again, whole, and waits on.
    ended = SeqProgress("r1-b0:1", 1, [4], None, "stop", offset=7)
    orders = core.on_report(report([ended], held=[started_key(started)]), 1.2)
    assert orders.report_whole == [("r1-b0:1", 1)] and not orders.start and list(core.adoption.awaiting_orphans) == ["r1-b0:1"]
    core.expire(1.2 + router_adoption.ADOPT_WAIT_S)  # it never comes (an engine that kept nothing)
    (late,) = core.decide("a", 11.3).start
    assert late.seq_id == f"{bid}:1" and late.prompt_token_ids == PROMPT and not core.adoption.awaiting_orphans
    assert not core.adoption.whole_asked


def test_a_replica_that_lists_nothing_of_the_old_router_releases_the_waiting_sequences():
    core = new_router()  # replica a has not listed what it runs yet: anything may still run there
    bid = core.submit([request()], 1.0, previous_ids=["r1-b0:0"])
    assert not core.decide("a", 1.1).start
    (started,) = core.on_report(report(held=[]), 1.5).start  # its listing: nothing of the old router's
    assert started.seq_id == f"{bid}:0" and not core.adoption.awaiting_orphans


def started_key(work) -> tuple:
    return (work.seq_id, work.attempt)


def test_of_two_attempts_the_old_router_made_the_latest_is_kept():
    core = new_router()
    later = SeqProgress("r1-b0:2", 2, [7, 7, 7], [-1.0] * 3, "abort", offset=0, prompt_token_ids=PROMPT + [6],
                        weight_versions=[(0, 0)])
    earlier = SeqProgress("r1-b0:2", 1, [6], [-1.0], "abort", offset=0, prompt_token_ids=PROMPT)
    core.on_report(report([later, earlier], held=[]), 1.0)
    assert core.adoption.orphan_outputs["r1-b0:2"].attempt == 2
    bid = core.submit([request(logprobs=None)], 2.0, previous_ids=["r1-b0:2"])
    assert list(core.seqs[f"{bid}:0"].token_ids) == [6, 7, 7, 7]


def test_a_replica_that_goes_takes_its_listing_of_old_segments_with_it():
    core = new_router()
    core.on_report(report(held=[("r1-b0:1", 1)]), 0.5)
    bid = core.submit([request()], 1.0, previous_ids=["r1-b0:1"])
    assert core.adoption.orphan_listings == {"r1-b0:1": 1} and core.adoption.awaiting_orphans
    core.on_report(Report("b", "i1", progress=[], stats=EngineStats(), model=ModelInfo(1000, 4096), capacity=4,
                          listing=Listing([], [])), 1.1)
    core.remove_replica("a", 1.2)  # died with the old segment: it runs nowhere now
    assert not core.adoption.orphan_listings
    # b's listing shows nothing old; the fleet counts 2, so one that has not joined may still hold it
    assert not core.decide("b", 1.3).start
    core.expire(1.0 + router_adoption.ADOPT_WAIT_S)
    (started,) = core.decide("b", 11.1).start
    assert started.seq_id == f"{bid}:0" and started.prompt_token_ids == PROMPT


def test_a_take_over_is_counted_in_the_prometheus_metrics():
    from rollout_cluster.serve.metrics import PrometheusRouterMetrics

    metrics = PrometheusRouterMetrics(port=0)
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), id_prefix="r2-", metrics=metrics)
    core.on_report(report(), 0.0)
    orphan_handed_over(core, whole("r1-b0:3", [11, 12], [-1.0, -2.0]))
    core.submit([request()], 2.0, previous_ids=["r1-b0:3"])
    assert metrics.registry.get_sample_value("rollout_sequences_resumed_total",
                                             {"source": "a", "reason": "router_restart"}) == 1
