"""The Serve router names the report interval in every answer to a pull: router.report_interval_s,
lengthened as the fleet grows past router.max_pulls_per_s, and holds an idle replica's pull by the
same rule, so that the router's pull load stays bounded whatever the fleet size (each pull costs
it milliseconds: experiments/router-cost). The router class runs here without Serve: its
pull is a plain coroutine."""
import asyncio
import time

import pytest

from rollout_cluster.config import ClusterConfig, EngineConfig, RouterConfig, to_dict
from rollout_cluster.serve.router import Router
from router_support import pull
from rollout_cluster.protocol import EngineStats, ModelInfo, Report


def report(rid: str, leaving: bool = False) -> Report:
    return Report(rid, "i1", progress=[], stats=EngineStats(), model=ModelInfo(100, 64), capacity=8,
                  leaving=leaving)


def test_pull_answers_name_an_interval_that_follows_the_live_fleet():
    cfg = ClusterConfig(replicas=2, engine=EngineConfig(kind="sim"),
                        router=RouterConfig(report_interval_s=0.2, max_pulls_per_s=2.0, idle_pull_wait_s=0.05))

    async def go():
        router = Router.func_or_class(to_dict(cfg))
        try:
            joined = [(await pull(router, report(f"r{i}"))).report_interval_s for i in range(4)]
            await pull(router, report("r3", leaving=True))
            after_leave = (await pull(router, report("r0"))).report_interval_s
            return joined, after_leave
        finally:
            router._reaper.cancel()

    joined, after_leave = asyncio.run(go())
    assert joined == pytest.approx([0.5, 1.0, 1.5, 2.0])  # n live replicas / 2 pulls a second
    assert after_leave == pytest.approx(1.5)


def test_an_idle_pull_is_held_longer_in_a_larger_fleet_and_new_work_still_wakes_it():
    from rollout_cluster.protocol import SamplingSpec, SequenceRequest

    cfg = ClusterConfig(replicas=2, engine=EngineConfig(kind="sim"),
                        router=RouterConfig(max_pulls_per_s=4.0, idle_pull_wait_s=0.05))

    async def held_s(router, rid):
        t0 = time.monotonic()
        await pull(router, report(rid))
        return time.monotonic() - t0

    async def go():
        router = Router.func_or_class(to_dict(cfg))
        try:
            alone = await held_s(router, "r0")  # 1 replica: 0.25 s
            for rid in ("r1", "r2", "r3"):
                await pull(router, report(rid))
            four = await held_s(router, "r0")  # 4 replicas: 1.0 s
            pending = asyncio.ensure_future(held_s(router, "r1"))
            await asyncio.sleep(0.05)
            await router.submit([SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=4), 0, 0)])
            woken = await pending
            return alone, four, woken
        finally:
            router._reaper.cancel()

    alone, four, woken = asyncio.run(go())
    # Upper bounds loose: these may run beside the e2e cluster's engines on a 2-core machine.
    assert 0.24 <= alone < 0.7
    assert 0.95 <= four < 1.6
    assert woken < 0.5  # the submit woke the held pull (held, it would take 1.0 s)
