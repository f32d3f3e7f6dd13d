"""A keep swap (update_weights running="keep") that fails inside vLLM leaves the weights a mix of
old and new: no token sampled on them is kept.

Found in review: when rc_swap_apply raised (or left parameters without a tensor) the replica
raised WeightsLoadBroken and Serve restarted it, but until then its running requests went on
generating on the half-swapped weights, and the router kept those tokens. Now the running
attempts report nothing from the moment the swap is applied until it is known to have gone in
whole; when it broke, each ends as "abort" with the tokens it made before, and the router
continues it elsewhere from them. The fake AsyncLLM below makes tokens 100 + i on whole weights
and 900 + i once the swap began, and keeps stepping on the broken weights for a while before
the failure comes back (as vLLM's EngineCore does after a failed utility call)."""
import asyncio

import pytest
import torch

from rollout_cluster.config import EngineConfig, PolicyConfig
from rollout_cluster.engines.base import WeightsLoadBroken
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.engines.vllm_engine import VllmEngine
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import (EngineStats, LoadWeights, ModelInfo, Report, SamplingSpec, SequenceRequest,
                                      WeightsState)
from rollout_cluster.router.core import RouterCore
from test_router_adoption import Out

COST = load_profile("h200-1.5b", max_num_seqs=4)
BROKEN = 900  # a token at or above it was sampled on broken weights


@pytest.fixture(autouse=True)
def no_served_checkpoint(monkeypatch):
    """The served model "m" has no checkpoint or config here: the swap checks names only."""
    from rollout_cluster.engines import weight_checks

    monkeypatch.setattr(weight_checks, "load_spec", lambda path: None)


class SwappingLLM:
    """Streams one token every 5 ms per request until aborted; `fail`: how rc_swap_apply fails
    ("raise", or "missing": it returns parameters that got no tensor), after `steps_s` of steps
    on the broken weights. None: the swap goes in whole."""

    errored = False

    def __init__(self, fail="raise", steps_s: float = 0.05):
        self.fail, self.steps_s = fail, steps_s
        self.broken = self.swapped = False
        self.aborted, self.running = set(), {}

    async def generate(self, prompt, params, request_id):
        for t in range(2000):
            if request_id in self.aborted:
                yield Out([], finished=True, reason="abort")
                return
            self.running[request_id] = t + 1
            yield Out([(BROKEN if self.broken else 100) + t])
            await asyncio.sleep(0.005)

    async def abort(self, ids):
        self.aborted.update(ids)

    async def collective_rpc(self, method, args=(), kwargs=None):
        if method == "rc_swap_stage":
            return [1]
        if method == "rc_swap_apply":
            if self.fail is None:
                self.swapped = True
                return [{"missing": [], "sampled": {f"{rid}-0a1b2c3d": n for rid, n in self.running.items()}}]
            self.broken = True
            await asyncio.sleep(self.steps_s)  # the engine steps on, on the half-swapped weights
            if self.fail == "raise":
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            return [{"missing": ["model.norm.weight"], "sampled": {}}]
        return None

    async def reset_prefix_cache(self):
        return True


def engine(llm) -> VllmEngine:
    eng = VllmEngine(EngineConfig(), "m", on_cpu=True)
    eng.engine = llm
    return eng


async def swap(eng: VllmEngine, version: int = 2):
    return await eng.load_tensors([[("model.norm.weight", torch.zeros(4))]], keep_as=version)


async def reports_until_done(eng: VllmEngine, load, every_s: float = 0.004) -> tuple:
    """Drain as a pull loop does, every few ms, while `load` runs and until no attempt is held.
    Returns (every progress drained, the load's exception or None)."""
    out, task = [], asyncio.ensure_future(load)
    while not task.done() or eng.held():
        out += eng.drain()
        await asyncio.sleep(every_s)
    out += eng.drain()
    return out, task.exception()


@pytest.mark.parametrize("fail", ["raise", "missing"])
def test_no_token_sampled_on_weights_a_failed_keep_swap_broke_is_reported(fail):
    async def go():
        eng = engine(SwappingLLM(fail))
        for i in range(3):
            eng.submit(_work(f"s{i}"))
        await asyncio.sleep(0.04)
        return await reports_until_done(eng, swap(eng))

    progress, error = asyncio.run(go())
    assert isinstance(error, WeightsLoadBroken)
    for sid in ("s0", "s1", "s2"):
        mine = [p for p in progress if p.seq_id == sid]
        tokens = [t for p in mine for t in p.token_ids]
        assert tokens and all(t < BROKEN for t in tokens), tokens  # only the whole weights' tokens
        assert tokens == [100 + i for i in range(len(tokens))]
        (final,) = [p for p in mine if p.finish_reason]
        # handed back at the tokens it made before: the router continues it from there
        assert final is mine[-1] and final.finish_reason == "abort" and final.offset == len(tokens)


def test_a_keep_swap_that_goes_in_whole_holds_no_token_back():
    async def go():
        eng = engine(SwappingLLM(fail=None))
        eng.submit(_work("s0"))
        await asyncio.sleep(0.03)
        await swap(eng, 2)
        await asyncio.sleep(0.03)
        early = eng.drain()
        await eng.give_up([("s0", 1)])
        while eng.held():
            await asyncio.sleep(0.005)
        return early + eng.drain()

    progress = asyncio.run(asyncio.wait_for(go(), 5.0))
    tokens = [t for p in progress for t in p.token_ids]
    assert tokens == [100 + i for i in range(len(tokens))]  # nothing dropped, nothing held back
    marks = {tuple(m) for p in progress if p.swaps for m in p.swaps}
    assert len(marks) == 1 and next(iter(marks))[1] == 2
    assert progress[-1].finish_reason == "abort" and progress[-1].offset == len(tokens)


def test_the_router_continues_a_broken_swaps_sequences_elsewhere_from_their_whole_tokens():
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST))
    core.on_report(_report("a"), 0.0)
    bid = core.submit([SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=1000, ignore_eos=True), i, 0)
                       for i in range(2)], 0.1)
    work = core.decide("a", 0.2).start
    assert len(work) == 2
    core.on_report(_report("b"), 0.25)  # b joins: it takes the sequences once a gives them back

    async def run_a():
        eng = engine(SwappingLLM("raise"))
        for w in work:
            eng.submit(w)
        t = 0.3
        for _ in range(8):  # the sequences run on version 0
            await asyncio.sleep(0.005)
            core.on_report(_report("a", eng.drain()), t)
            t += 0.01
        orders = core.update_weights("/ckpt/2", running="keep"), core.decide("a", t)
        assert [c for c in orders[1].control if isinstance(c, LoadWeights)] == [LoadWeights("/ckpt/2", 1, keep=True)]
        load = asyncio.ensure_future(swap(eng, 1))
        while not load.done() or eng.held():
            core.on_report(_report("a", eng.drain(), loading=1), t)
            t += 0.01
            await asyncio.sleep(0.004)
        core.on_report(_report("a", eng.drain(), error=f"replica a: {load.exception()}", error_version=1), t)
        return t

    t = asyncio.run(run_a())
    for s in core.seqs.values():  # back in the queue, with only the whole weights' tokens
        assert s.token_ids.tolist() == [100 + i for i in range(s.generated)] and s.generated > 0
    assert not core.decide("a", t + 0.1).start  # a failed the load: no work for it
    again = core.on_report(_report("b", version=1, path="/ckpt/2"), t + 0.2).start  # b holds the new weights
    assert sorted(w.seq_id for w in again) == sorted(w.seq_id for w in work)
    assert all(w.prompt_token_ids[3:] == [100 + i for i in range(len(w.prompt_token_ids) - 3)] for w in again)
    assert bid in core.batches


def _work(sid: str):
    from rollout_cluster.protocol import Work

    return Work(sid, 1, [1, 2, 3], SamplingSpec(max_tokens=1000, ignore_eos=True))


def _report(rid: str, progress=(), version: int = 0, path: str = "", **weights) -> Report:
    return Report(rid, "i1", progress=list(progress), stats=EngineStats(), model=ModelInfo(1000, 4096), capacity=4,
                  weights=WeightsState(version=version, path=path, **weights))
