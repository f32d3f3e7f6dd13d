"""The Serve router names the report interval in every answer to a pull: router.report_interval_s,
lengthened as the fleet grows past router.max_pulls_per_s, so that the router's pull load stays
bounded whatever the fleet size (each pull costs it milliseconds: docs/benchmarks.md, section 5).
The router class runs here without Serve: its pull is a plain coroutine."""
import asyncio

import pytest

from rollout_cluster.config import ClusterConfig, EngineConfig, RouterConfig, to_dict
from rollout_cluster.serve.router import Router
from rollout_cluster.types import EngineStats, ModelInfo, Report


def report(rid: str, leaving: bool = False) -> Report:
    return Report(rid, "i1", [], EngineStats(), ModelInfo(100, 64), 8, leaving=leaving)


def test_pull_answers_name_an_interval_that_follows_the_live_fleet():
    cfg = ClusterConfig(replicas=2, engine=EngineConfig(kind="sim"),
                        router=RouterConfig(report_interval_s=0.2, max_pulls_per_s=2.0, idle_pull_wait_s=0.05))

    async def go():
        router = Router.func_or_class(to_dict(cfg))
        try:
            joined = [(await router.pull(report(f"r{i}"))).report_interval_s for i in range(4)]
            await router.pull(report("r3", leaving=True))
            after_leave = (await router.pull(report("r0"))).report_interval_s
            return joined, after_leave
        finally:
            router._reaper.cancel()

    joined, after_leave = asyncio.run(go())
    assert joined == pytest.approx([0.5, 1.0, 1.5, 2.0])  # n live replicas / 2 pulls a second
    assert after_leave == pytest.approx(1.5)
