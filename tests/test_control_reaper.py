"""The Serve router's reaper (serve/router.py _reap) keeps running: it expires silent
replicas every second for the router's whole life."""
import asyncio

from rollout_cluster.config import ClusterConfig, to_dict
from rollout_cluster.protocol import EngineStats, ModelInfo, Report, SamplingSpec, SequenceRequest
from rollout_cluster.router import batches as batches_module
from rollout_cluster.serve import router as router_module
from rollout_cluster.serve.router import Router
from router_support import Clock, FastAsyncio


def report(rid: str) -> Report:
    return Report(rid, "i1", stats=EngineStats(), model=ModelInfo(100, 64), capacity=4)


def test_the_reaper_survives_more_abandoned_batches_in_one_tick_than_it_remembers(monkeypatch):
    """A driver that submitted many small batches (one per prompt group) dies: they are all
    abandoned in the same tick. Batches.drop remembers only DROPPED_KEPT reasons, the reaper then
    looks up the reason of each dropped batch for its log line: KeyError, and the reaper task
    ends. From then on no silent replica is ever expired (nor stall, nor abandoned batch)."""
    clock = Clock()
    monkeypatch.setattr(router_module, "time", clock)
    monkeypatch.setattr(router_module, "asyncio", FastAsyncio())

    async def go():
        cfg = ClusterConfig(replicas=1, engine={"kind": "sim"}, router={"abandoned_batch_s": 10.0})
        router = Router.func_or_class(to_dict(cfg))
        core = router.core
        try:
            core.apply(report("a"), clock.monotonic())
            for i in range(batches_module.DROPPED_KEPT + 1):  # more abandoned batches than DROPPED_KEPT (1024)
                core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=2), 0, 0)], clock.monotonic())
            clock.offset = 20.0  # no fetch for 20 s; "a" keeps pulling
            core.apply(report("a"), clock.monotonic())
            await asyncio.sleep(0.2)  # the reaper drops them
            assert not core.batches.live
            core.apply(report("b"), clock.monotonic())  # a replica that then goes silent
            clock.offset = 20.0 + 2 * cfg.router.replica_timeout_s
            core.apply(report("a"), clock.monotonic())
            await asyncio.sleep(0.2)
            reaper = router._reaper
            crash = reaper.exception() if reaper.done() and not reaper.cancelled() else None
            return sorted(core.fleet.replicas), crash
        finally:
            router._reaper.cancel()

    live, crash = asyncio.run(go())
    assert crash is None, f"the reaper ended: {crash!r}"
    assert live == ["a"], f"silent replica b was never expired: live {live}"
