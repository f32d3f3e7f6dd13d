"""client/fleet_ops.wait_until: the probe schedule, the deadline, and what it returns."""
import time

import pytest

from rollout_cluster.client.fleet_ops import wait_until


class Probe:
    def __init__(self, settle_at: int):
        self.calls, self.settle_at = 0, settle_at

    def __call__(self) -> int:
        self.calls += 1
        return self.calls

    def settled(self, n: int):
        return f"done at {n}" if n >= self.settle_at else None


def test_a_first_interval_doubles_up_to_the_interval():
    probe, gaps = Probe(settle_at=7), []
    got = wait_until(probe, probe.settled, time.monotonic() + 60, 0.1, lambda v: TimeoutError(v),
                     first_interval_s=0.01, sleep=gaps.append)
    assert got == "done at 7"
    assert gaps == pytest.approx([0.01, 0.02, 0.04, 0.08, 0.1, 0.1])


def test_without_a_first_interval_every_gap_is_the_interval():
    probe, gaps = Probe(settle_at=4), []
    assert wait_until(probe, probe.settled, time.monotonic() + 60, 0.2, lambda v: None, sleep=gaps.append) == "done at 4"
    assert gaps == [0.2, 0.2, 0.2]


def test_a_first_interval_longer_than_the_interval_is_cut_to_it():
    probe, gaps = Probe(settle_at=3), []
    wait_until(probe, probe.settled, time.monotonic() + 60, 0.1, lambda v: None, first_interval_s=5.0,
               sleep=gaps.append)
    assert gaps == [0.1, 0.1]


def test_past_the_deadline_the_last_value_goes_to_timed_out():
    probe = Probe(settle_at=10 ** 9)
    with pytest.raises(TimeoutError, match="^1$"):  # one probe, then the deadline (already past)
        wait_until(probe, probe.settled, time.monotonic() - 1, 0.1, lambda v: TimeoutError(str(v)))
    assert probe.calls == 1
    # a wait that may end unsettled: timed_out gives no error, the wait returns None
    assert wait_until(Probe(10 ** 9), lambda v: None, time.monotonic() - 1, 0.1, lambda v: None) is None
