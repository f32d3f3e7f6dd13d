"""A vLLM engine that dies under its sequences (EngineCore crashed: GPU fault, out of memory) must
not fail them: they get no final report, the replica says goodbye with the tokens they made, the
router continues them elsewhere from there, and Serve replaces the replica (check_health)."""
import asyncio

import pytest

from rollout_cluster.config import ClusterConfig, EngineConfig, PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.engines.vllm_engine import VllmEngine
from rollout_cluster.policy import make_policy
from rollout_cluster.router_core import RouterCore
from rollout_cluster.serve.replica import EngineReplica
from rollout_cluster.types import EngineStats, ModelInfo, Report, SamplingSpec, SequenceRequest, Work

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
    await asyncio.gather(*eng.tasks.values())
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

    def stats(self):
        return EngineStats()


class RouterHandle:
    """Router.pull through a RouterCore, as the deployment would."""

    def __init__(self, core):
        self.core = core
        self.reports = []

    @property
    def pull(self):
        outer = self

        class Pull:
            @staticmethod
            def remote(report):
                async def call():
                    outer.reports.append(report)
                    return outer.core.on_report(report, 1.0)
                return call()
        return Pull


class BareReplica(EngineReplica.func_or_class):
    def __del__(self):
        pass


def test_the_replica_hands_back_and_stops_and_the_router_continues_its_sequences_elsewhere():
    from rollout_cluster.types import SeqProgress

    core = RouterCore(make_policy(PolicyConfig(name="pull"), load_profile("h200-1.5b", 8)), 2, 1e9)
    core.on_report(Report("a", "a-1", [], EngineStats(), ModelInfo(100, 64), 8), 0.0)
    bid = core.submit([SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=8), 0, 0)], 0.0)
    (w,) = core.decide("a", 0.0).start
    core.on_report(Report("a", "a-1", [SeqProgress(w.seq_id, w.attempt, [5, 6], offset=0)], EngineStats(), None, 8), 0.5)
    engine = DeadEngine()
    engine.pending = [SeqProgress(w.seq_id, w.attempt, [7], offset=2)]  # made before it died, not yet sent
    r = object.__new__(BareReplica)
    r.cfg, r.engine, r.router, r.stopping = ClusterConfig(), engine, RouterHandle(core), False
    r.replica_id, r.incarnation, r.unsent, r.weights_version, r.loop_error = "a", "a-1", [], 0, None

    async def go():
        r.task = asyncio.get_running_loop().create_task(r._pull_loop())
        await asyncio.wait_for(r.task, 5)

    asyncio.run(go())
    (goodbye,) = r.router.reports
    assert goodbye.leaving and [p.token_ids for p in goodbye.progress] == [[7]]
    with pytest.raises(RuntimeError, match="the engine died: RuntimeError: EngineCore encountered an issue"):
        r.check_health()
    # the sequence continues on another replica from all three tokens, with nothing lost or repeated
    (again,) = core.on_report(Report("b", "b-1", [], EngineStats(), ModelInfo(100, 64), 8), 2.0).start
    assert again.prompt_token_ids == [1, 2, 3, 5, 6, 7] and again.sampling.max_tokens == 5
    core.on_report(Report("b", "b-1", [SeqProgress(w.seq_id, again.attempt, [1] * 5, None, "length")],
                          EngineStats(), None, 8), 3.0)
    (done,) = core.fetch(bid, 0)[0]
    assert done.token_ids == [5, 6, 7, 1, 1, 1, 1, 1] and done.finish_reason == "length"
    assert done.replicas == ["a", "b"]
