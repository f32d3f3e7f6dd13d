"""The replica's timeline (serve/timeline.py), without Ray: with ROLLOUT_TIMELINE_DIR set, each
pull of the loop writes what it carried and where its time went, and the lag probe writes how late
the event loop ran a timer. Off (None) without the variable."""
import asyncio
import json
import time

from rollout_cluster.config import RouterConfig
from rollout_cluster.protocol import Orders, SeqProgress, SleepState, WeightsState
from rollout_cluster.serve.pull_loop import PullLoop
from rollout_cluster.serve.timeline import ENV, Timeline


class Engine:
    """Two running sequences; each drain gives one delta of 3 tokens for each."""

    ended, dead, capacity = 0, None, 8

    def drain(self) -> list:
        return [SeqProgress(f"s{i}", 1, [1, 2, 3]) for i in range(2)]

    def held(self) -> list:
        return [("s0", 1), ("s1", 1)]

    def aborting(self) -> list:
        return []

    def stats(self):
        from rollout_cluster.protocol import EngineStats
        return EngineStats(running=2)

    def forget_finals(self, progress) -> None:
        pass


class Moves:
    weights_version = 0
    broken = None  # the engine's weights are whole
    digest = None  # no weights digest to send

    def digest_delivered(self, answer):
        pass

    def states(self):
        return WeightsState(), SleepState()


def test_off_without_the_variable(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert Timeline.from_env("replica-a") is None


def test_each_pull_and_the_loops_lag_are_recorded(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, str(tmp_path))
    timeline = Timeline.from_env("replica-a")

    async def slow_router(report):
        await asyncio.sleep(0.02)
        return Orders(report_interval_s=0.05)

    async def go():
        timeline.start_probe()
        loop = PullLoop(Engine(), Moves(), slow_router, replica_id="a", incarnation="i1", model=None,
                        router_cfg=RouterConfig(report_interval_s=0.05), timeline=timeline)
        for _ in range(3):
            await loop.step()
        time.sleep(0.03)  # blocks the event loop: the probe sees it late
        await asyncio.sleep(0.06)

    asyncio.run(go())
    timeline.close()
    lines = [json.loads(line) for line in (tmp_path / "replica-a.jsonl").read_text().splitlines()]
    pulls = [x for x in lines if x["kind"] == "pull"]
    assert len(pulls) == 3
    assert all(p["progress"] == 2 and p["tokens"] == 6 and p["held"] == 2 for p in pulls)
    assert all(p["pull_ms"] >= 15 for p in pulls)  # the router's 20 ms
    assert all(p["pace_ms"] >= 20 for p in pulls)  # paced to the 50 ms interval
    assert max(x["worst_ms"] for x in lines if x["kind"] == "lag") >= 20  # the 30 ms block
