"""A Router that Serve (re)starts expects the live EngineReplica deployment's target, not the
config's count (serve/fleet_target.py).

Regression (h-route9, item 3): after RolloutClient.scale(4) on a config of 2, a restarted router
expected 2 replicas: it took its fleet as heard after two reports and could number a weights
order at or below a version the other two held (weights_floor.py), and static's shares left them
out; after a scale-down it waited a replica timeout for replicas that never come."""
import asyncio

import pytest

from rollout_cluster.client import fleet_ops
from rollout_cluster.config import ClusterConfig, to_dict
from rollout_cluster.protocol import EngineStats, ModelInfo, Report, WeightsNotLearned, WeightsState
from rollout_cluster.serve import fleet_target
from rollout_cluster.serve.replica import EngineReplica
from rollout_cluster.serve.router import Router


def details(target, app="rollout", deployment="EngineReplica") -> dict:
    return {"applications": {app: {"deployments": {deployment: {"target_num_replicas": target}}}}}


def test_the_target_is_read_from_serves_instance_details():
    assert fleet_target.target_in(details(4), "rollout") == 4
    assert fleet_target.target_in(details(4), "other") is None
    assert fleet_target.target_in(details(4, deployment="Router"), "rollout") is None
    for bad in (0, -1, True, "4", None):
        assert fleet_target.target_in(details(bad), "rollout") is None, bad
    assert fleet_target.target_in({}, "rollout") is None and fleet_target.target_in(None, "rollout") is None


def test_the_deployment_name_is_the_engine_replicas():
    assert fleet_target.REPLICA_DEPLOYMENT == EngineReplica.name == fleet_ops.REPLICA_DEPLOYMENT


def test_a_restarted_router_expects_the_live_target_a_scale_set_not_the_configs_count(monkeypatch):
    monkeypatch.setattr(fleet_target, "serve_target", lambda: 4)  # scale(4) before the restart

    async def start():
        router = Router.func_or_class(to_dict(ClusterConfig(replicas=2, engine={"kind": "sim"})))
        router._reaper.cancel()
        return router.core

    core = asyncio.run(start())
    assert core.fleet.expected == 4
    for i, rid in enumerate("ab"):  # two of the four report (the config's count)
        core.apply(Report(rid, "i1", stats=EngineStats(), model=ModelInfo(100, 64), capacity=4,
                          weights=WeightsState(version=5, path="/ckpt/5")), 0.1 * i)
    with pytest.raises(WeightsNotLearned, match="2 of the 4 replica"):  # c and d may hold more
        core.update_weights("/ckpt/new", now=1.0)


def test_outside_serve_or_without_an_answer_the_configs_count_stands(monkeypatch):
    assert fleet_target.serve_target() is None  # no replica context: nothing asked, no Ray started
    assert fleet_target.expected_replicas(3) == 3

    def no_answer():
        raise TimeoutError("the controller did not answer")

    monkeypatch.setattr(fleet_target, "serve_target", no_answer)
    assert fleet_target.expected_replicas(3) == 3
    monkeypatch.setattr(fleet_target, "serve_target", lambda: 1)
    assert fleet_target.expected_replicas(3) == 1
