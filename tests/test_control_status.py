"""What status() says of the fleet's weights, as the driver's waits (client/fleet_ops.py) read it."""
import time

import pytest

from rollout_cluster.client import fleet_ops
from rollout_cluster.protocol import LoadWeights
from test_fleet_sleep import core_with, pull


class StatusOnly:
    def __init__(self, core):
        self.core, self.config = core, None

    def status(self) -> dict:
        return {"weights": self.core.weights_status(), "sleep": self.core.sleep_status(),
                "expected_replicas": self.core.fleet.expected, "live_sequences": len(self.core.seqs),
                "replicas": {rid: {} for rid in self.core.fleet.replicas}}


def test_a_replica_holding_the_same_number_from_another_source_is_not_counted_as_holding_it():
    """A replica cut off from a restarted router comes back holding version 4 of other weights
    (its predecessor's /ckpt/B) while the router numbered /ckpt/C 4. The router knows it does not
    hold the fleet's weights (it orders the load, gives it no work); status()['weights']['replicas']
    reports the number alone, so update_weights' wait counts it as holding version 4 and returns
    before the fleet is there."""
    core = core_with(("a", "b"))
    v = core.update_weights("/ckpt/C", 4)
    for rid in ("a", "b"):
        pull(core, rid, 1.0)
        pull(core, rid, 1.1, version=v, path="/ckpt/C")
    orders = pull(core, "c", 1.2, version=4, path="/ckpt/B")  # the partitioned one is back
    assert [o for o in orders.control if isinstance(o, LoadWeights)]  # the router orders it /ckpt/C
    assert not core.weights.holds(core.fleet.replicas["c"])
    with pytest.raises(TimeoutError):  # c has not loaded the fleet's weights
        fleet_ops.wait_for_version(StatusOnly(core), v, "/ckpt/C", "update_weights", timeout_s=0.3)


class LiveFleet(StatusOnly):
    """Each status() is 30 s later on the router's clock: a and b pull (holding `v`), c is gone."""

    def __init__(self, core, v):
        super().__init__(core)
        self.v, self.t = v, 1.2

    def status(self) -> dict:
        self.t += 30.0
        for rid in ("a", "b"):
            pull(self.core, rid, self.t, version=self.v, path="/ckpt/C")
        self.core.expire(self.t)
        return super().status()


def test_update_weights_follows_the_expected_count_the_router_reports_as_sleep_does():
    """c dies during the update and no replacement comes: a replica timeout later the router
    lowers expected_replicas to the 2 that live, both holding the version. wait_for_version read
    expected_replicas once, before its wait, and times out on the stale 3 (sleep and wake's wait
    reads it from every status)."""
    core = core_with(("a", "b", "c"))
    v = core.update_weights("/ckpt/C", 4)
    for rid in ("a", "b", "c"):
        pull(core, rid, 1.0)
    client = LiveFleet(core, v)
    assert fleet_ops.wait_for_version(client, v, "/ckpt/C", "update_weights", timeout_s=1.0) == v
    assert core.fleet.expected == 2 and sorted(core.fleet.replicas) == ["a", "b"]
