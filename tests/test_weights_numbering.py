"""A weights version names one set of weights for good: a router that restarted (and starts at
version 0) numbers no weights order at or below a version its fleet holds, loads, noted or
failed, and numbers none before it heard every replica it expects (or a replica timeout passed).
Found in review: a restarted router took update_weights before its replicas reported and
numbered it 1 while they held 5, so `weights_version` 1 named two different weights."""
import asyncio
import time

import pytest

from rollout_cluster.client import fleet_ops
from rollout_cluster.client.client import RolloutClient
from rollout_cluster.config import ClusterConfig, PolicyConfig, to_dict
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import (EngineStats, InputError, LoadWeights, ModelInfo, Report, WeightsNotLearned,
                                      WeightsState)
from rollout_cluster.router.core import RouterCore
from router_support import order, pull

COST = load_profile("h200-1.5b", max_num_seqs=8)


def restarted(expected: int = 2, timeout_s: float = 60.0) -> RouterCore:
    return RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=expected,
                      replica_timeout_s=timeout_s)


def report(core: RouterCore, rid: str, now: float, **weights) -> None:
    core.on_report(Report(rid, "i1", stats=EngineStats(), model=ModelInfo(1000, 4096), capacity=8,
                          weights=WeightsState(**weights)), now)


def loads(core: RouterCore, rid: str) -> list:
    return [c for c in core.outbox.to(rid).control if isinstance(c, LoadWeights)]


def test_a_restarted_router_numbers_no_weights_order_below_what_its_fleet_holds_or_loads():
    core = restarted()
    with pytest.raises(WeightsNotLearned, match=r"update_weights: this router is new \(or restarted.*heard the "
                                                r"weights of 0 of the 2 replica\(s\).*retry"):
        core.update_weights("/ckpt/new", now=0.0)  # nobody reported yet: it would have been version 1
    report(core, "a", 0.5, version=5, path="/ckpt/5")
    with pytest.raises(WeightsNotLearned, match=r"heard the weights of 1 of the 2 .*highest reported so far: 5"):
        core.update_weights("/ckpt/new", buckets=("ref",), now=1.0)
    assert core.weights.version == 5 and not loads(core, "a")  # refused: nothing changed
    # b still loads version 6, which the router before the restart ordered
    report(core, "b", 1.5, version=5, path="/ckpt/5", loading=6)
    for low in (1, 5, 6):
        with pytest.raises(InputError, match=rf"version={low}: must be an integer above 6, the highest version the "
                                             r"fleet knows \(replica b loads it; this router's current version is 5\)"):
            core.update_weights("/ckpt/new", low, now=2.0)
    assert core.update_weights("/ckpt/new", now=2.0) == 7
    assert loads(core, "a") == [LoadWeights("/ckpt/new", 7)]


def test_a_version_a_replica_noted_asleep_or_failed_to_load_is_no_number_either():
    core = restarted()
    report(core, "a", 0.0, version=3, path="/ckpt/3", noted=8, noted_path="/ckpt/8")
    report(core, "b", 0.1, version=3, path="/ckpt/3", error="bad bytes", error_version=9)
    assert core.weights.checked("/ckpt/new", None) == 10
    with pytest.raises(InputError, match=r"version=9: must be an integer above 9, .*replica b failed to load it"):
        core.weights.checked("/ckpt/new", 9)


def test_replicas_silent_for_a_replica_timeout_hold_weights_orders_up_no_longer():
    core = restarted(expected=3, timeout_s=10.0)
    core.expire(0.0)  # the Serve router's reaper checks from its start
    report(core, "a", 0.5, version=4, path="/ckpt/4")
    with pytest.raises(WeightsNotLearned, match="1 of the 3"):
        core.update_weights("/ckpt/new", now=9.0)
    assert core.update_weights("/ckpt/new", now=10.5) == 5  # b and c are dead: their replacements start at 0
    # heard once, heard for good: a replica's death later holds no order up
    core.remove_replica("a", 11.0)
    report(core, "a2", 12.0, version=5, path="/ckpt/new")
    assert core.update_weights("/ckpt/newer", now=12.5) == 6


def test_a_replica_that_joins_later_with_a_higher_version_raises_the_floor():
    core = restarted(expected=1)
    report(core, "a", 0.0, version=2, path="/ckpt/2")
    assert core.weights.checked("/ckpt/new", None) == 3
    report(core, "late", 0.5, version=2, path="/ckpt/2", loading=3)
    assert core.update_weights("/ckpt/new", now=1.0) == 4


def test_the_driver_asks_again_while_a_new_router_refuses_within_its_timeout(monkeypatch):
    """The driver's update_weights asks again (signed anew) while a new router refuses, within its
    timeout, and past it raises the refusal."""
    calls, answers = [], []

    class Handle:
        def __getattr__(self, name):
            def remote(*args):
                calls.append(name)
                if name == "status":
                    value = {"weights": {"version": 7, "path": "/ckpt/new", "replicas": {"a": 7}, "held": ["a"], "errors": {}},
                             "sleep": {"level": 0}, "expected_replicas": 1, "live_sequences": 0}
                else:
                    value = answers.pop(0)

                def result(self, timeout_s=None):
                    if isinstance(value, Exception):
                        raise value
                    return value
                return type("R", (), {"result": result})()
            return type("M", (), {"remote": staticmethod(remote)})()

    monkeypatch.setattr(fleet_ops, "NUMBER_RETRY_S", 0.01)
    client = object.__new__(RolloutClient)
    client.router, client.call_timeout_s, client.config = Handle(), 5.0, None
    answers[:] = [WeightsNotLearned("not yet")] * 2 + [7]
    assert client.update_weights("/ckpt/new", timeout_s=30) == 7
    assert calls.count("update_weights") == 3
    answers[:] = [WeightsNotLearned("not yet")] * 1000
    t0 = time.monotonic()
    with pytest.raises(WeightsNotLearned, match="not yet"):
        client.update_weights("/ckpt/new", timeout_s=0.3)
    assert time.monotonic() - t0 < 2.0


def test_the_serve_router_refuses_an_update_until_it_heard_its_replicas(tmp_path):
    from rollout_cluster.serve.router import Router

    async def go():
        cfg = ClusterConfig(replicas=2, engine={"kind": "sim"}, security={"checkpoint_roots": [str(tmp_path)]})
        router = Router.func_or_class(to_dict(cfg))
        try:
            for rid in ("a", "b"):
                await pull(router, Report(rid, "i1", stats=EngineStats(), model=ModelInfo(100, 64), capacity=4,
                                          weights=WeightsState(version=5, path="/old/5")))
                if rid == "a":
                    with pytest.raises(WeightsNotLearned, match="1 of the 2"):
                        await router.update_weights(order("update_weights", path=str(tmp_path), version=None,
                                                          running="finish"))
                    with pytest.raises(WeightsNotLearned, match="1 of the 2"):
                        await router.push_weights(order("push_weights", source="push://x", version=None,
                                                        buckets=["00"], tensors=1, bytes=1, running="finish"),
                                                  [type("Ref", (), {"hex": lambda self: "00"})()])
            with pytest.raises(InputError, match=r"version=5: must be an integer above the current version 5"):
                await router.update_weights(order("update_weights", path=str(tmp_path), version=5, running="finish"))
            return await router.update_weights(order("update_weights", path=str(tmp_path), version=None,
                                                     running="finish"))
        finally:
            router._reaper.cancel()

    assert asyncio.run(go()) == 6
