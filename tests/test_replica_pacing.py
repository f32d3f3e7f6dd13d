"""A replica's report pacing (serve/pull_loop.py), without Ray: a replica that runs sequences
reports every router.report_interval_s, and earlier only when an ended segment matters now (work
is queued for its slot, or a give-up's partials go back; not before half the interval) or the
replica has become idle. The real cluster's pull rates are checked in tests/e2e/test_cluster.py."""
import asyncio
import time

from rollout_cluster.config import URGENT_REPORT_GAP_FRAC, RouterConfig
from rollout_cluster.serve.pull_loop import PullLoop

INTERVAL = 1.0


class FakeEngine:
    def __init__(self, held: int):
        self.ended = 0
        self.dead = None
        self._held = held

    def held(self) -> list:
        return [("s", i) for i in range(self._held)]

    def end_one(self) -> None:
        self._held -= 1
        self.ended += 1


def replica(engine: FakeEngine) -> PullLoop:
    return PullLoop(engine, None, None, replica_id="a", incarnation="i1", model=None,
                    router_cfg=RouterConfig(report_interval_s=INTERVAL))


def paced(held: int, urgent: bool, end_after_s=None, interval_s: float = 0.0) -> float:
    """Seconds pace waited; `end_after_s`: a segment ends that long after the report;
    `interval_s`: the interval the router's orders named (0: the config's)."""
    engine = FakeEngine(held)
    r = replica(engine)

    async def go():
        t0 = time.monotonic()
        if end_after_s is not None:
            asyncio.get_running_loop().call_later(end_after_s, engine.end_one)
        await r.pace(t0, engine.ended, urgent, interval_s)
        return time.monotonic() - t0

    return asyncio.run(go())


def test_a_busy_replica_reports_once_per_interval():
    assert INTERVAL * 0.95 <= paced(held=3, urgent=False) < INTERVAL * 2


def test_an_ended_segment_is_reported_at_once_when_work_waits_for_its_slot():
    # past URGENT_REPORT_GAP_FRAC of the interval since the last report: at once
    assert INTERVAL * 0.7 <= paced(held=3, urgent=True, end_after_s=INTERVAL * 0.7) < INTERVAL * 0.95


def test_an_urgent_end_soon_after_a_report_waits_for_the_gap():
    # a replica pulls at most twice an interval, however often its segments end
    assert URGENT_REPORT_GAP_FRAC == 0.5
    assert INTERVAL * 0.5 <= paced(held=3, urgent=True, end_after_s=0.1) < INTERVAL * 0.9


def test_an_urgent_end_in_a_large_fleet_waits_for_half_the_interval_it_names():
    assert INTERVAL * 1.0 <= paced(held=3, urgent=True, end_after_s=0.1, interval_s=INTERVAL * 2) < INTERVAL * 1.9


def test_an_ended_segment_waits_for_the_interval_when_nothing_needs_its_slot():
    assert paced(held=3, urgent=False, end_after_s=0.1) >= INTERVAL * 0.95


def test_a_replica_whose_last_segment_ended_pulls_at_once():
    assert paced(held=1, urgent=False, end_after_s=0.1) < INTERVAL / 2


def test_an_idle_replica_does_not_pace():
    assert paced(held=0, urgent=False) < INTERVAL / 10


def test_the_interval_the_router_names_replaces_the_configs():
    assert INTERVAL * 0.3 * 0.95 <= paced(held=3, urgent=False, interval_s=INTERVAL * 0.3) < INTERVAL * 0.6
    assert INTERVAL * 1.5 * 0.95 <= paced(held=3, urgent=False, interval_s=INTERVAL * 1.5) < INTERVAL * 3


def test_a_replica_whose_engine_died_stops_pacing_at_once():
    async def go():
        r = replica(FakeEngine(held=3))
        t0 = time.monotonic()
        asyncio.get_running_loop().call_later(0.1, lambda: setattr(r.engine, "dead", RuntimeError("gone")))
        await r.pace(t0, r.engine.ended, urgent=False)
        return time.monotonic() - t0

    assert asyncio.run(go()) < INTERVAL * 0.5
