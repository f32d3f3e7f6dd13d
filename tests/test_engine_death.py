"""A vLLM engine that dies under its sequences (EngineCore crashed: GPU fault, out of memory) must
not fail them: they get no final report, the replica says goodbye with the tokens they made, the
router continues them elsewhere from there, and Serve replaces the replica (check_health)."""
import asyncio

import pytest

from rollout_cluster.config import ClusterConfig, EngineConfig, PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.engines.vllm_engine import VllmEngine
from rollout_cluster.policy import make_policy
from rollout_cluster.router.core import RouterCore
from rollout_cluster.serve.replica import EngineReplica
from rollout_cluster.protocol import EngineStats, ModelInfo, Report, SamplingSpec, SequenceRequest, Work

vllm_exceptions = pytest.importorskip("vllm.v1.engine.exceptions", reason="the vLLM build is part of the test env")


class Out:
    def __init__(self, toks, finished=False):
        self.outputs = [type("O", (), {"token_ids": toks, "finish_reason": None, "logprobs": None})()]
        self.finished = finished


class DyingAsyncLLM:
    """Streams two deltas, then its EngineCore dies; requests after that fail at once."""

    def __init__(self):
        self.errored = False

    async def generate(self, prompt, params, request_id):
        if self.errored:
            raise vllm_exceptions.EngineDeadError()
        yield Out([5, 6])
        await asyncio.sleep(0.01)
        yield Out([7])
        self.errored = True
        raise vllm_exceptions.EngineDeadError()


class RefusingAsyncLLM:
    errored = False

    async def generate(self, prompt, params, request_id):
        raise ValueError("temperature must be finite")
        yield  # an async generator


def work(seq_id: str, attempt: int = 1) -> Work:
    return Work(seq_id, attempt, [1, 2, 3], SamplingSpec(max_tokens=8))


async def run_two(fake) -> VllmEngine:
    eng = VllmEngine(EngineConfig(), "m", on_cpu=True)
    eng.engine = fake
    eng.submit(work("s0"))
    await asyncio.sleep(0.05)
    eng.submit(work("s1"))  # into the dead engine
    await asyncio.gather(*eng.seqs.tasks.values())
    return eng


def test_a_dead_engine_gives_its_sequences_no_final_report_and_says_it_died():
    eng = asyncio.run(run_two(DyingAsyncLLM()))
    out = eng.drain()
    assert [(p.seq_id, p.token_ids, p.finish_reason) for p in out] == [("s0", [5, 6], None), ("s0", [7], None)]
    assert isinstance(eng.dead, vllm_exceptions.EngineDeadError)
    assert eng.held() == [] and eng.ended == 0


def test_an_engine_that_dies_while_idle_is_noticed_at_the_next_drain():
    eng = VllmEngine(EngineConfig(), "m", on_cpu=True)
    eng.engine = DyingAsyncLLM()
    assert eng.drain() == [] and eng.dead is None
    eng.engine.errored = True
    assert eng.drain() == [] and "EngineCore died" in str(eng.dead)


def test_a_request_vllm_refuses_still_fails_alone():
    eng = asyncio.run(run_two(RefusingAsyncLLM()))
    out = eng.drain()
    assert [(p.seq_id, p.finish_reason) for p in out] == [("s0", "error"), ("s1", "error")]
    assert "temperature must be finite" in out[0].error and eng.dead is None


class DeadEngine:
    capacity = 8
    ended = 0

    def __init__(self):
        self.dead = RuntimeError("EngineCore encountered an issue")
        self.pending = []

    def drain(self):
        out, self.pending = self.pending, []
        return out

    def whole_final(self, p):
        return p

    def forget_finals(self, delivered):
        pass

    def stats(self):
        return EngineStats()


class RouterHandle:
    """Router.pull through a RouterCore, as the deployment would."""

    def __init__(self, core):
        self.core = core
        self.reports = []

    def answer(self, report):
        return self.core.on_report(report, 1.0)

    @property
    def pull(self):
        outer = self

        class Pull:
            @staticmethod
            def remote(report):
                async def call():
                    outer.reports.append(report)
                    return outer.answer(report)
                return call()
        return Pull


class BareReplica(EngineReplica.func_or_class):
    def __del__(self):
        pass


def bare_replica(engine, core):
    """An EngineReplica over `engine` and a router handle over `core`, without Serve."""
    r = object.__new__(BareReplica)
    r.cfg, r.engine, r.router = ClusterConfig(), engine, RouterHandle(core)
    r.link = type("Link", (), {"pull": staticmethod(lambda report: r.router.pull.remote(report))})()
    r.replica_id, r.incarnation, r.model = "a", "a-1", ModelInfo(100, 64)
    return r


def run_loop(r):
    """Start the replica's pull loop and wait until it ends."""
    async def go():
        r._start_loop()
        await asyncio.wait_for(r.task, 5)

    asyncio.run(go())


def test_the_replica_hands_back_and_stops_and_the_router_continues_its_sequences_elsewhere():
    from rollout_cluster.protocol import SeqProgress

    core = RouterCore(make_policy(PolicyConfig(name="pull"), load_profile("h200-1.5b", 8)), 2, 1e9)
    core.on_report(Report("a", "a-1", progress=[], stats=EngineStats(), model=ModelInfo(100, 64), capacity=8), 0.0)
    bid = core.submit([SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=8), 0, 0)], 0.0)
    (w,) = core.decide("a", 0.0).start
    core.on_report(Report("a", "a-1", progress=[SeqProgress(w.seq_id, w.attempt, [5, 6], offset=0)],
                          stats=EngineStats(), model=None, capacity=8), 0.5)
    engine = DeadEngine()
    engine.pending = [SeqProgress(w.seq_id, w.attempt, [7], offset=2)]  # made before it died, not yet sent
    r = bare_replica(engine, core)
    run_loop(r)
    (goodbye,) = r.router.reports
    assert goodbye.leaving and goodbye.engine_dead and [p.token_ids for p in goodbye.progress] == [[7]]
    # a death, not a scale-down: Serve replaces the replica, the fleet keeps its size
    assert core.counters.replica_deaths == 1 and core.counters.replica_leaves == 0
    assert core.fleet.expected == 2
    with pytest.raises(RuntimeError, match="the engine died: RuntimeError: EngineCore encountered an issue"):
        r.check_health()
    # the sequence continues on another replica from all three tokens, with nothing lost or repeated
    (again,) = core.on_report(Report("b", "b-1", progress=[], stats=EngineStats(), model=ModelInfo(100, 64),
                                     capacity=8), 2.0).start
    assert again.prompt_token_ids == [1, 2, 3, 5, 6, 7] and again.sampling.max_tokens == 5
    core.on_report(Report("b", "b-1", progress=[SeqProgress(w.seq_id, again.attempt, [1] * 5, None, "length")],
                          stats=EngineStats(), model=None, capacity=8), 3.0)
    (done,) = core.fetch(bid, 0)[0]
    assert done.token_ids == [5, 6, 7, 1, 1, 1, 1, 1] and done.finish_reason == "length"
    assert done.replicas == ["a", "b"]


class IdleThenDead(DeadEngine):
    """Alive at first; dies while idle, which only the next drain notices (vLLM's `errored`)."""

    def __init__(self, die_at_drain: int):
        super().__init__()
        self.dead, self.drains, self.die_at = None, 0, die_at_drain
        self.submitted = []

    def drain(self):
        self.drains += 1
        if self.drains >= self.die_at:
            self.dead = RuntimeError("vLLM's EngineCore died (AsyncLLM.errored)")
        return super().drain()

    def held(self):
        return []

    def aborting(self):
        return []

    def submit(self, work):
        self.submitted.append(work)




def test_an_engine_found_dead_at_a_drain_sends_no_ordinary_report_and_gets_no_work():
    core = RouterCore(make_policy(PolicyConfig(name="pull"), load_profile("h200-1.5b", 8)), 2, 1e9)
    core.on_report(Report("b", "b-1", progress=[], stats=EngineStats(), model=ModelInfo(100, 64), capacity=8), 0.0)  # another replica
    core.submit([SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=8), i, 0) for i in range(4)], 0.0)
    engine = IdleThenDead(die_at_drain=1)
    r = bare_replica(engine, core)
    run_loop(r)
    assert [rep.leaving for rep in r.router.reports] == [True]  # its goodbye only
    assert engine.submitted == [] and len(core.queue) == 4


class GiveUpMeetsDeadEngine(IdleThenDead):
    async def give_up(self, keys):  # an adapter that records the death and raises too
        self.dead = RuntimeError("EngineDeadError")
        raise self.dead


def test_orders_that_meet_a_dead_engine_end_in_a_goodbye_not_a_crash():
    from rollout_cluster.protocol import Orders

    engine = GiveUpMeetsDeadEngine(die_at_drain=10 ** 9)

    class Handle(RouterHandle):
        def answer(self, report):  # the first reply orders a give-up, which meets the dead engine
            return Orders(give_up=[("s", 1)]) if len(self.reports) == 1 else Orders()

    r = bare_replica(engine, None)
    r.router = Handle(None)
    run_loop(r)
    assert [rep.leaving for rep in r.router.reports] == [False, True] and r.router.reports[1].engine_dead
    assert r.pull_loop.error is not None and "died" in str(r.pull_loop.error)


class AbortOnDeadEngine(DyingAsyncLLM):
    async def abort(self, request_ids):
        raise vllm_exceptions.EngineDeadError()  # vLLM's abort goes through ensure_alive


def test_vllms_abort_on_a_dead_engine_marks_it_dead_instead_of_raising():
    async def go():
        eng = VllmEngine(EngineConfig(), "m", on_cpu=True)
        eng.engine = AbortOnDeadEngine()
        eng.submit(work("s0"))
        await asyncio.sleep(0)
        await eng.give_up([("s0", 1)])
        assert isinstance(eng.dead, vllm_exceptions.EngineDeadError) and not eng.seqs.aborted
        for t in list(eng.seqs.tasks.values()):
            t.cancel()

    asyncio.run(go())


class LateRequestAsyncLLM:
    """Registers a request only when its stream is first read, as AsyncLLM.generate does, and
    ignores an abort of an id it does not have yet."""

    errored = False

    def __init__(self):
        self.live, self.aborts = set(), []

    async def abort(self, request_ids):
        self.aborts.append(list(request_ids))
        self.live.difference_update(request_ids)

    async def generate(self, prompt, params, request_id):
        self.live.add(request_id)
        for i in range(50):
            if request_id not in self.live:
                out = Out([], finished=True)
                out.outputs[0].finish_reason = "abort"
                yield out
                return
            yield Out([i])
            await asyncio.sleep(0.001)
        yield Out([], finished=True)


def test_a_give_up_that_reaches_the_engine_before_its_request_still_stops_it():
    async def go():
        eng = VllmEngine(EngineConfig(), "m", on_cpu=True)
        eng.engine = fake = LateRequestAsyncLLM()
        eng.submit(work("s0"))
        await eng.give_up([("s0", 1)])  # in the same reply: before the request's task ran
        await asyncio.gather(*eng.seqs.tasks.values())
        return eng, fake

    eng, fake = asyncio.run(go())
    out = eng.drain()
    assert fake.aborts == [["s0#1"], ["s0#1"]]  # the first found nothing; the second stopped it
    assert out[-1].finish_reason == "abort" and sum(len(p.token_ids) for p in out) < 5
