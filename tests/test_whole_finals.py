"""A segment that ends while its router cannot be reached is not generated again.

Its final report is a delta: the tokens since the last report. If the router restarted meanwhile,
the new one never got the earlier deltas, and the delta alone is useless to it. So a replica
whose pull failed sends its undelivered finals whole (the engine keeps each ended segment's
output until its final is delivered): a new router keeps that output for the sequence's
resubmission (router/adoption.py), and the old one, if it was only slow, drops the part it has.
"""
import asyncio

from rollout_cluster.config import ClusterConfig, EngineConfig, PolicyConfig, RouterConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.engines.vllm_engine import VllmEngine
from rollout_cluster.policy import make_policy
from rollout_cluster.router.core import RouterCore
from rollout_cluster.serve.engine_moves import EngineMoves
from rollout_cluster.serve.pull_loop import PullLoop
from rollout_cluster.protocol import (EngineStats, Listing, ModelInfo, Orders, Report, SamplingSpec, SeqProgress,
                                      SequenceRequest, Work)
from test_router_adoption import Out

COST = load_profile("h200-1.5b", max_num_seqs=4)
PROMPT = [5, 6, 7]


# ---- the vLLM adapter keeps an ended segment's whole output until its final is delivered ---------
class ShortAsyncLLM:
    """Streams `n` tokens, one every 5 ms, then finishes with "length"; stops early when aborted."""

    errored = False

    def __init__(self, n: int):
        self.n, self.aborted = n, set()

    async def generate(self, prompt, params, request_id):
        for t in range(self.n):
            if request_id in self.aborted:
                yield Out([], finished=True, reason="abort")
                return
            last = t == self.n - 1
            yield Out([100 + t], finished=last, reason="length" if last else None)
            await asyncio.sleep(0.005)

    async def abort(self, ids):
        self.aborted.update(ids)


def run_engine(n: int, give_up_after_s=None, prior_logprobs=None):
    async def go():
        eng = VllmEngine(EngineConfig(), "m", on_cpu=True)
        eng.engine = ShortAsyncLLM(n)
        eng.submit(Work("r1-b0:0", 1, list(PROMPT), SamplingSpec(max_tokens=100, logprobs=0),
                        prior_logprobs=prior_logprobs))
        await asyncio.sleep(0.03)
        first = eng.drain()
        if give_up_after_s is not None:
            await eng.give_up([("r1-b0:0", 1)])
        await asyncio.gather(*eng.seqs.tasks.values())
        return eng, first, eng.drain()

    return asyncio.run(go())


def test_the_vllm_adapter_gives_an_undelivered_final_whole_until_it_is_delivered():
    eng, first, rest = run_engine(12)
    (final,) = [p for p in rest if p.finish_reason]
    assert final.finish_reason == "length" and final.offset > 0 and final.prompt_token_ids is None
    streamed = [t for p in first + rest for t in p.token_ids]
    assert streamed == [100 + t for t in range(12)]
    w = eng.whole_final(final)
    assert (w.seq_id, w.attempt, w.finish_reason, w.offset) == ("r1-b0:0", 1, "length", 0)
    assert w.token_ids == streamed and w.logprobs == [-0.25] * 12 and w.prompt_token_ids == PROMPT
    assert eng.whole_final(w) is w  # already whole
    assert eng.whole_final(first[0]) is first[0]  # not a final
    eng.forget_finals(first + rest)
    assert eng.whole_final(final) is final and not eng.seqs.ended_whole


def test_a_continuations_whole_final_carries_the_logprobs_its_work_brought():
    eng, first, rest = run_engine(5, prior_logprobs=[-0.5, -0.6])
    (final,) = [p for p in first + rest if p.finish_reason]
    w = eng.whole_final(final)
    assert w.prior_logprobs == [-0.5, -0.6] and w.logprobs == [-0.25] * 5


def test_an_aborted_segment_is_kept_whole_too():
    eng, first, rest = run_engine(1000, give_up_after_s=0.0)
    (final,) = [p for p in rest if p.finish_reason]
    assert final.finish_reason == "abort"
    w = eng.whole_final(final)
    assert w.offset == 0 and w.token_ids == [t for p in first + rest for t in p.token_ids] and w.token_ids


# ---- the replica sends its finals whole after a failed pull -------------------------------------
class EndingEngine:
    """One segment: a delta, then (at the next drain) its final."""
    capacity, dead = 8, None

    def __init__(self):
        self.ended, self.drains, self.forgotten = 0, 0, []
        self.whole = SeqProgress("s", 1, [4, 5, 6], None, "stop", offset=0, prompt_token_ids=[1, 2])

    def drain(self) -> list:
        self.drains += 1
        if self.drains == 1:
            return [SeqProgress("s", 1, [4, 5], offset=0)]
        if self.drains == 2:
            self.ended = 1
            return [SeqProgress("s", 1, [6], None, "stop", offset=2)]
        return []

    def whole_final(self, p):
        return self.whole if (p.seq_id, p.attempt, p.finish_reason) == ("s", 1, "stop") else p

    def forget_finals(self, delivered):
        self.forgotten += [p for p in delivered if p.finish_reason]

    def held(self) -> list:
        return [("s", 1)] if self.drains < 2 else []

    def aborting(self) -> list:
        return []

    def stats(self) -> EngineStats:
        return EngineStats(running=1)


class RouterFailingSecond:
    """Answers the first pull, fails the second (a router that died), answers the third."""

    def __init__(self, replica):
        self.reports, self.replica = [], replica
        self.pull = self

    def remote(self, report):
        self.reports.append(report)
        n = len(self.reports)

        async def answer():
            if n == 2:
                raise RuntimeError("router died")
            if n == 3:
                self.replica.stop()
            return Orders()
        return answer()


def pull_loop(engine, pull=None) -> PullLoop:
    cfg = ClusterConfig(router=RouterConfig(replica_timeout_s=1.0, idle_pull_wait_s=0.05, report_interval_s=0.01))
    return PullLoop(engine, EngineMoves(engine, cfg, "a"), pull, replica_id="a", incarnation="i1", model=None,
                    router_cfg=cfg.router)


def run_replica(engine, make_router):
    """A replica's pull loop over `engine` and the fake router `make_router(loop)`, until that
    router stops it. Returns (loop, router)."""
    r = pull_loop(engine, lambda report: router.pull.remote(report))
    router = make_router(r)
    asyncio.run(asyncio.wait_for(r.run(), 5.0))
    return r, router


def test_a_replica_sends_its_undelivered_final_whole_after_a_failed_pull():
    r, router = run_replica(EndingEngine(), RouterFailingSecond)
    first, failed, again = [rep.progress for rep in router.reports[:3]]
    assert [(p.token_ids, p.offset) for p in first] == [([4, 5], 0)]
    assert [(p.token_ids, p.offset, p.finish_reason) for p in failed] == [([6], 2, "stop")]  # sent as a delta
    assert again == [r.engine.whole]  # after the failure: whole
    assert r.engine.forgotten == [r.engine.whole]  # delivered: the engine may drop it


# ---- the routers ---------------------------------------------------------------------------------
def report(progress=(), held=None) -> Report:
    return Report("a", "i1", progress=list(progress), stats=EngineStats(), model=ModelInfo(1000, 4096), capacity=4,
                  listing=None if held is None else Listing(held, []))


def router(prefix: str) -> RouterCore:
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), id_prefix=prefix)
    core.on_report(report(), 0.0)
    return core


def request(max_tokens=10) -> SequenceRequest:
    return SequenceRequest(list(PROMPT), SamplingSpec(max_tokens=max_tokens, logprobs=0), 0, 0)


def test_the_router_that_was_only_slow_takes_the_tail_of_a_whole_final_once():
    core = router("r1-")
    bid = core.submit([request()], 0.0)
    (w,) = core.decide("a", 0.1).start
    core.on_report(report([SeqProgress(w.seq_id, w.attempt, [11, 12], [-1.0, -2.0], offset=0)]), 0.2)
    resent = SeqProgress(w.seq_id, w.attempt, [11, 12], [-1.0, -2.0], offset=0)
    core.on_report(report([resent]), 0.3)  # a delta sent again: dropped
    assert core.counters.duplicate_reports == 1
    whole = SeqProgress(w.seq_id, w.attempt, [11, 12, 13], [-1.0, -2.0, -3.0], "stop", offset=0,
                        prompt_token_ids=list(PROMPT))
    core.on_report(report([whole], held=[]), 0.4)
    (c,), _, done = core.fetch(bid, 0)
    assert done
    assert list(c.token_ids) == [11, 12, 13] and list(c.logprobs) == [-1.0, -2.0, -3.0]
    assert c.finish_reason == "stop" and not c.migrations
    assert core.counters.finals_whole_trimmed == 1 and core.counters.generated_tokens == 3
    core.release(bid)
    core.on_report(report([whole], held=[]), 0.5)  # again, its reply lost: the router's own, finished
    assert core.counters.orphan_outputs_kept == 0 and not core.adoption.orphan_outputs


def test_a_segment_that_ended_while_no_router_listened_finishes_its_resubmission():
    old = router("r1-")
    old.submit([request(), request()], 0.0)
    work = old.decide("a", 0.1).start
    old.on_report(report([SeqProgress(w.seq_id, w.attempt, [11, 12], [-1.0, -2.0], offset=0) for w in work]), 0.2)
    # the old router dies; both segments end on the replica; its pull failed, so the finals go whole
    new = router("r2-")
    ended = [SeqProgress(w.seq_id, w.attempt, [11, 12, 13], [-1.0, -2.0, -3.0], "stop", offset=0,
                         prompt_token_ids=list(PROMPT)) for w in work]
    new.on_report(report(ended, held=[]), 1.0)
    assert new.counters.orphan_outputs_kept == 2
    bid = new.submit([request(), request()], 1.5, previous_ids=[w.seq_id for w in work])
    got, _, done = new.fetch(bid, 0)
    assert done
    assert len(got) == 2 and new.counters.adopted == 2
    for c in got:
        assert list(c.token_ids) == [11, 12, 13] and list(c.logprobs) == [-1.0, -2.0, -3.0]
        assert c.finish_reason == "stop" and [m.reason for m in c.migrations] == ["router_restart"]
    assert not new.decide("a", 1.6).start  # nothing generated again


def test_a_final_that_reached_a_new_router_as_a_delta_is_asked_for_again_whole():
    """The replica's pull went through the restart: it sent the old segment's final as a delta
    to the new router, which asks for it again whole (the engine still keeps it) and takes it."""
    new = router("r2-")
    delta = SeqProgress("r1-b0:0", 1, [13], [-3.0], "stop", offset=2)
    orders = new.on_report(report([delta], held=[]), 1.0)
    assert orders.report_whole == [("r1-b0:0", 1)] and new.counters.orphan_outputs_kept == 0
    assert not new.on_report(report([delta], held=[]), 1.1).report_whole  # asked once
    bid = new.submit([request()], 1.2, previous_ids=["r1-b0:0"])
    assert not new.decide("a", 1.3).start  # it waits for the whole output
    whole = SeqProgress("r1-b0:0", 1, [11, 12, 13], [-1.0, -2.0, -3.0], "stop", offset=0, prompt_token_ids=list(PROMPT))
    new.on_report(report([whole], held=[]), 1.4)
    (c,), _, done = new.fetch(bid, 0)
    assert done and list(c.token_ids) == [11, 12, 13] and [m.reason for m in c.migrations] == ["router_restart"]
    assert not new.adoption.whole_asked and new.counters.adopted == 1


def test_the_vllm_adapter_sends_an_ended_final_again_whole_when_asked():
    eng, first, rest = run_engine(12)
    (final,) = [p for p in rest if p.finish_reason]
    eng.report_whole([("r1-b0:0", 1)])
    (again,) = eng.drain()
    assert again.offset == 0 and again.finish_reason == "length" and again.prompt_token_ids == PROMPT
    assert again.token_ids == [100 + t for t in range(12)] and again.logprobs == [-0.25] * 12
    eng.report_whole([("r1-b0:0", 1)])  # once
    assert not eng.drain() and not eng.seqs.ended_whole


def test_a_goodbye_sends_the_finals_whole_where_another_router_may_take_them():
    cases = {("A", "A", False): "delta", ("A", "B", False): "whole", ("A", "A", True): "whole"}
    for (started_by, answering, failed), want in cases.items():
        r = pull_loop(EndingEngine())
        r.dispatched, r.router_id, r.pull_failed = {("s", 1): started_by}, answering, failed
        r.unsent = [SeqProgress("s", 1, [6], None, "stop", offset=2)]
        (p,) = r.goodbye().progress
        assert (p.offset, p.token_ids) == ((0, [4, 5, 6]) if want == "whole" else (2, [6])), (started_by, answering)


class StartedEngine(EndingEngine):
    """EndingEngine whose segment is started by the router's first answer."""

    def __init__(self):
        super().__init__()
        self.submitted = []

    def submit(self, work):
        self.submitted.append(work)

    def drain(self) -> list:
        return super().drain() if self.submitted else []

    def held(self) -> list:
        return [("s", 1)] if self.submitted and self.drains < 2 else []


class RouterRestartingBetweenPulls:
    """Every pull answered: the first by router A (which starts the segment), the rest by `later`."""

    def __init__(self, replica, later: str):
        self.reports, self.replica, self.later = [], replica, later
        self.pull = self

    def remote(self, report):
        self.reports.append(report)
        n = len(self.reports)

        async def answer():
            if n == 1:
                return Orders(start=[Work("s", 1, [1, 2], SamplingSpec(max_tokens=3))], router_id="A")
            if n >= 3 and report.progress:
                self.replica.stop()
            return Orders(router_id=self.later)
        return answer()


def test_a_final_of_a_segment_another_router_started_goes_whole():
    sent = {}
    for later in ("A", "B"):
        r, router = run_replica(StartedEngine(), lambda replica: RouterRestartingBetweenPulls(replica, later))
        sent[later] = [p for rep in router.reports for p in rep.progress if p.finish_reason]
        assert not r.dispatched  # delivered: forgotten
    assert [(p.token_ids, p.offset) for p in sent["A"]] == [([6], 2)]  # its own router: a delta
    assert [(p.token_ids, p.offset) for p in sent["B"]] == [([4, 5, 6], 0)]  # another router: whole


def test_a_goodbyes_delta_final_is_not_asked_for_again_and_its_resubmission_starts():
    new = router("r2-")
    new.on_report(Report("b", "i1", progress=[], stats=EngineStats(), model=ModelInfo(1000, 4096), capacity=4,
                         listing=Listing([], [])), 0.1)
    bid = new.submit([request()], 0.5, previous_ids=["r1-b0:0"])  # waits: replica b has not listed
    delta = SeqProgress("r1-b0:0", 1, [13], [-3.0], "stop", offset=2)
    goodbye = Report("a", "i1", progress=[delta], stats=EngineStats(), model=None, capacity=4, leaving=True)
    assert not new.on_report(goodbye, 1.0).report_whole and not new.adoption.whole_asked
    (w,) = new.decide("b", 1.1).start  # it ended with a's goodbye: from its prompt, at once
    assert w.seq_id == f"{bid}:0" and w.prompt_token_ids == PROMPT


def test_a_whole_final_that_never_comes_releases_its_resubmission_when_the_ask_expires():
    from rollout_cluster.router import adoption as router_adoption
    new = router("r2-")
    new.on_report(report([SeqProgress("r1-b0:0", 1, [13], [-3.0], "stop", offset=2)], held=[]), 1.0)
    bid = new.submit([request()], 5.0, previous_ids=["r1-b0:0"])
    assert not new.decide("a", 5.1).start  # waits for the whole output asked at 1.0
    new.expire(1.0 + router_adoption.ADOPT_WAIT_S)  # the ask expires before the claim's own wait
    (w,) = new.decide("a", 11.1).start
    assert w.seq_id == f"{bid}:0" and not new.adoption.awaiting_orphans and not new.adoption.whole_asked


def test_chunked_rounds_carry_no_prior_logprobs_and_other_continuations_do():
    """A continuation's Work carries its earlier logprobs, but not a chunked round's (every round
    of every sequence: their size would grow as the square of the length)."""
    for policy, end, want in (("chunked", "length", None), ("pull", "abort", [-1.0] * 4)):
        pc = PolicyConfig(name=policy, **({"chunk_tokens": 4} if policy == "chunked" else {}))
        core = RouterCore(make_policy(pc, COST), id_prefix="r1-")
        core.on_report(report(), 0.0)
        core.submit([request(max_tokens=10)], 0.0)
        (w,) = core.decide("a", 0.1).start
        # chunked: the round's cap ends it; pull: the replica hands it back (an abort nobody ordered)
        (w2,) = core.on_report(report([SeqProgress(w.seq_id, w.attempt, [1, 2, 3, 4], [-1.0] * 4, end, offset=0)],
                                      held=[]), 0.2).start
        assert w2.seq_id == w.seq_id and w2.prompt_token_ids == PROMPT + [1, 2, 3, 4], policy
        assert (None if w2.prior_logprobs is None else list(w2.prior_logprobs)) == want, policy


# Regression: a final sent whole (after a failed pull, or asked for again) left out the keep swap
# (SeqProgress.swaps) its delta carried, so a router that never got that delta labelled the new
# weights' tokens of the segment with the old version.
def test_a_final_sent_whole_keeps_the_weights_swap_its_delta_carried():
    core = router("r1-")
    bid = core.submit([request()], 0.0)
    (w,) = core.decide("a", 0.1).start

    async def go():
        eng = VllmEngine(EngineConfig(), "m", on_cpu=True)
        eng.engine = ShortAsyncLLM(12)
        eng.submit(w)
        await asyncio.sleep(0.03)
        first = eng.drain()
        eng.seqs.swapped({f"{w.seq_id}#{w.attempt}": sum(p.num_tokens for p in first)}, 1)  # a keep swap
        await asyncio.gather(*eng.seqs.tasks.values())
        return eng, first, eng.drain()

    eng, first, rest = asyncio.run(go())
    at = sum(p.num_tokens for p in first)
    (final,) = [p for p in rest if p.finish_reason]
    assert 0 < at < 12 and final.swaps == [(at, 1)]
    whole = eng.whole_final(final)  # the pull that carried the deltas after the swap failed
    assert whole.offset == 0 and whole.swaps == [(at, 1)]
    eng.report_whole([(w.seq_id, w.attempt)])  # asked for again, whole
    (again,) = eng.drain()
    assert again.swaps == [(at, 1)]
    core.on_report(report(first), 0.2)
    core.on_report(report([whole]), 0.3)
    (c,), _, done = core.fetch(bid, 0)
    assert done and len(c.token_ids) == 12 and c.weight_versions == [(0, 0), (at, 1)]


# Regression: a sequence that took over its old segment's output after a router restart had no
# weight_versions for those tokens ([] when it finished at once), and one whose old segment
# swapped weights under it (running="keep", SeqProgress.swaps) was taken over as if it had run
# on one version: adoption takes only a segment that ran on the batch's version throughout.
def test_a_taken_over_segment_is_labelled_and_one_that_swapped_weights_is_made_again():
    old = router("r1-")
    old.submit([request(), request()], 0.0)
    work = old.decide("a", 0.1).start
    new = router("r2-")
    ended = [SeqProgress(w.seq_id, w.attempt, [11, 12, 13], [-1.0, -2.0, -3.0], "stop", offset=0,
                         prompt_token_ids=list(PROMPT), swaps=[(1, 3)] if i else None) for i, w in enumerate(work)]
    new.on_report(report(ended, held=[]), 1.0)
    bid = new.submit([request(), request()], 1.5, previous_ids=[w.seq_id for w in work])
    got, _, _ = new.fetch(bid, 0)
    assert len(got) == 1 and new.counters.adopted == 1  # the first, taken over and finished
    (c,) = got
    assert list(c.token_ids) == [11, 12, 13] and c.weight_versions == [(0, 0)] and c.weights_version == 0
    (again,) = new.decide("a", 1.6).start  # the second is made again, from its prompt
    assert again.prompt_token_ids == PROMPT
