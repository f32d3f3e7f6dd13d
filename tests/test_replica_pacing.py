"""A replica's report pacing (serve/pull_loop.py), without Ray: a replica that runs sequences
reports every router.report_interval_s, and earlier only when an ended segment matters now (work
is queued for its slot, or a give-up's partials go back; not before half the interval) or the
replica has become idle. The real cluster's pull rates are checked in tests/e2e/test_cluster.py."""
import asyncio
from types import SimpleNamespace

import pytest

from rollout_cluster.config import URGENT_REPORT_GAP_FRAC, RouterConfig
from rollout_cluster.serve import pull_loop
from rollout_cluster.serve.pull_loop import PACE_TICK_S, PullLoop

INTERVAL = 1.0


class VirtualTime:
    """The loop's clock and its sleeps, in virtual seconds: a pace is measured exactly, whatever
    the machine's load (the real clock made these bounds flaky on a busy 2-core box)."""

    def __init__(self):
        self.t = 0.0
        self.events: list = []  # (at, fn): run once the clock passes `at`

    def clock(self) -> float:
        return self.t

    def at(self, t: float, fn) -> None:
        self.events.append((t, fn))

    async def sleep(self, dt: float) -> None:
        self.t += dt
        for event in [e for e in self.events if e[0] <= self.t]:
            self.events.remove(event)
            event[1]()
        await asyncio.sleep(0)


@pytest.fixture(autouse=True)
def virtual_time(monkeypatch):
    vt = VirtualTime()
    monkeypatch.setattr(pull_loop, "asyncio", SimpleNamespace(sleep=vt.sleep))
    return vt


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


def replica(engine: FakeEngine, vt: VirtualTime) -> PullLoop:
    return PullLoop(engine, None, None, replica_id="a", incarnation="i1", model=None,
                    router_cfg=RouterConfig(report_interval_s=INTERVAL), clock=vt.clock)


def paced(vt: VirtualTime, held: int, urgent: bool, end_after_s=None, interval_s: float = 0.0) -> float:
    """Virtual seconds pace waited; `end_after_s`: a segment ends that long after the report;
    `interval_s`: the interval the router's orders named (0: the config's)."""
    engine = FakeEngine(held)
    r = replica(engine, vt)
    if end_after_s is not None:
        vt.at(end_after_s, engine.end_one)
    asyncio.run(r.pace(0.0, engine.ended, urgent, interval_s))
    return vt.t


TICK = PACE_TICK_S * 1.5  # (the pace looks every tick: it ends within one of its moment)


def test_a_busy_replica_reports_once_per_interval(virtual_time):
    assert INTERVAL <= paced(virtual_time, held=3, urgent=False) < INTERVAL + TICK


def test_an_ended_segment_is_reported_at_once_when_work_waits_for_its_slot(virtual_time):
    # past URGENT_REPORT_GAP_FRAC of the interval since the last report: at once
    assert INTERVAL * 0.7 <= paced(virtual_time, held=3, urgent=True, end_after_s=INTERVAL * 0.7) < INTERVAL * 0.7 + TICK


def test_an_urgent_end_soon_after_a_report_waits_for_the_gap(virtual_time):
    # a replica pulls at most twice an interval, however often its segments end
    assert URGENT_REPORT_GAP_FRAC == 0.5
    assert INTERVAL * 0.5 <= paced(virtual_time, held=3, urgent=True, end_after_s=0.1) < INTERVAL * 0.5 + TICK


def test_an_urgent_end_in_a_large_fleet_waits_for_half_the_interval_it_names(virtual_time):
    got = paced(virtual_time, held=3, urgent=True, end_after_s=0.1, interval_s=INTERVAL * 2)
    assert INTERVAL * 1.0 <= got < INTERVAL * 1.0 + TICK


def test_an_ended_segment_waits_for_the_interval_when_nothing_needs_its_slot(virtual_time):
    assert INTERVAL <= paced(virtual_time, held=3, urgent=False, end_after_s=0.1) < INTERVAL + TICK


def test_a_replica_whose_last_segment_ended_pulls_at_once(virtual_time):
    assert 0.1 <= paced(virtual_time, held=1, urgent=False, end_after_s=0.1) < 0.1 + TICK


def test_an_idle_replica_does_not_pace(virtual_time):
    assert paced(virtual_time, held=0, urgent=False) == 0.0


def test_the_interval_the_router_names_replaces_the_configs(virtual_time):
    assert INTERVAL * 0.3 <= paced(virtual_time, held=3, urgent=False, interval_s=INTERVAL * 0.3) < INTERVAL * 0.3 + TICK
    later = VirtualTime()
    pull_loop.asyncio.sleep = later.sleep
    assert INTERVAL * 1.5 <= paced(later, held=3, urgent=False, interval_s=INTERVAL * 1.5) < INTERVAL * 1.5 + TICK


def test_a_replica_whose_engine_died_stops_pacing_at_once(virtual_time):
    engine = FakeEngine(held=3)
    r = replica(engine, virtual_time)
    virtual_time.at(0.1, lambda: setattr(engine, "dead", RuntimeError("gone")))
    asyncio.run(r.pace(0.0, engine.ended, urgent=False))
    assert 0.1 <= virtual_time.t < 0.1 + TICK
