"""A replica whose wake failed stays asleep (it notes each update and loads it at its next wake).
update_weights and push_weights must not wait their whole timeout for it, and must name it:
RolloutClient's waits (client/fleet_ops.py) read the router's status, built here by a real
RouterCore."""
import time

import pytest

from rollout_cluster.client import fleet_ops
from tests.test_fleet_sleep import asleep, core_with, pull


class StatusOnly:
    """What fleet_ops' waits read of a RolloutClient: the router's status (its weights and sleep parts)."""

    def __init__(self, core):
        self.core, self.config = core, None

    def status(self) -> dict:
        return {"weights": self.core.weights_status(), "sleep": self.core.sleep_status(),
                "expected_replicas": self.core.fleet.expected, "live_sequences": len(self.core.seqs)}


def woke_but_b(core):
    """The fleet wakes; a's engine wakes, b's wake fails (it stays at level 1)."""
    asleep(core, 1)
    core.wake_fleet()
    for rid in ("a", "b"):
        pull(core, rid, 0.9, level=1)  # the wake order goes out
    pull(core, "a", 1.0, level=0)
    pull(core, "b", 1.0, level=1, goal=0, error="CUDA out of memory while waking")
    assert core.sleep_status()["errors"] == {"b": "CUDA out of memory while waking"}
    return core


def test_an_update_with_a_replica_that_did_not_wake_fails_at_once_naming_it():
    core = woke_but_b(core_with())
    v = core.update_weights("/ckpt/step1")
    pull(core, "a", 2.0, version=v, path="/ckpt/step1")  # a loads it; b only notes it (asleep)
    pull(core, "b", 2.0, level=1, goal=0, error="CUDA out of memory while waking", noted=(v, "/ckpt/step1"))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"failed on 1 replica\(s\): replica b did not wake \(CUDA out of memory"):
        fleet_ops.wait_for_version(StatusOnly(core), v, "/ckpt/step1", "update_weights", timeout_s=30)
    assert time.monotonic() - t0 < 5  # not the timeout


def test_the_next_update_does_not_wait_for_it_either():
    core = woke_but_b(core_with())
    v = core.update_weights("/ckpt/step1")
    pull(core, "a", 2.0, version=v, path="/ckpt/step1")
    t0 = time.monotonic()
    fleet_ops.before_update(StatusOnly(core), "finish", time.monotonic() + 30)
    assert time.monotonic() - t0 < 5


def test_a_replica_still_loading_is_waited_for_and_named_when_the_time_is_up():
    core = core_with()
    v = core.update_weights("/ckpt/step1")
    pull(core, "a", 1.0, version=v, path="/ckpt/step1")
    pull(core, "b", 1.0, loading=v)
    with pytest.raises(TimeoutError, match=r"1 of 2 replicas hold version 1 after 1 s; still without it: b"):
        fleet_ops.wait_for_version(StatusOnly(core), v, "/ckpt/step1", "update_weights", timeout_s=1)


def test_once_it_wakes_and_loads_the_update_succeeds():
    core = woke_but_b(core_with())
    v = core.update_weights("/ckpt/step1")
    pull(core, "a", 2.0, version=v, path="/ckpt/step1")
    core.wake_fleet()  # again: b tries once more, and loads what it noted
    pull(core, "b", 2.5, level=1, goal=0, noted=(v, "/ckpt/step1"))  # the order goes out
    pull(core, "b", 3.0, level=0, version=v, path="/ckpt/step1")
    assert fleet_ops.wait_for_version(StatusOnly(core), v, "/ckpt/step1", "update_weights", timeout_s=5) == v
