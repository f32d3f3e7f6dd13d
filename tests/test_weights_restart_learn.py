"""A restarted router whose first word comes from a replica that lags the fleet (its load of the
old router's last version failed, so it still holds the version before, and reports that failure)
must not send the whole fleet back to that older version because a driver's first, unpinned batch
came in before the other replicas reported.

The first batch ends the router's learning (intake.py): the version is fixed from then on. Taken
after only the lagging replica spoke, it would fix that replica's version, and the replicas that
hold the old router's current version would be ordered to load the one before; with pushes, that
older push's handles went with the old router, and every such load fails. So a fresh router takes
a batch once it heard every replica it expects (RouterCore.weights_learned), and the Serve router
waits for that a few seconds (WEIGHTS_LEARN_WAIT_S) before taking the batch anyway."""
import asyncio
import time

from rollout_cluster.config import ClusterConfig, EngineConfig, PolicyConfig, to_dict
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import EngineStats, ModelInfo, Report, SamplingSpec, SequenceRequest, WeightsState
from rollout_cluster.router.core import RouterCore
from rollout_cluster.serve import router as router_module
from rollout_cluster.serve.router import Router
from rollout_cluster.transfer.push import PUSH_SCHEME

from router_support import pull
from test_weights import COST, loads

P1, P2 = f"{PUSH_SCHEME}p1", f"{PUSH_SCHEME}p2"
MODEL = ModelInfo(100, 64)
LAGGING = dict(version=1, path=P1, error="replica a: load_weights: bucket 3 refused", error_version=2, error_path=P2)


def report(rid, **weights):
    return Report(rid, "i1", progress=[], stats=EngineStats(), model=MODEL, capacity=8, weights=WeightsState(**weights))


def batch():
    return [SequenceRequest([1, 2], SamplingSpec(max_tokens=2), 0, 0)]


def test_a_fresh_router_takes_a_batch_once_it_heard_every_replica_and_then_keeps_the_fleets_version():
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=3)
    core.on_report(report("a", **LAGGING), 0.1)
    assert not core.weights_learned(None, 0.2)  # a alone spoke: it may lag the fleet
    core.on_report(report("b", version=2, path=P2), 0.3)
    assert not core.weights_learned(None, 0.3)
    at_c = core.on_report(report("c", version=2, path=P2), 0.3)
    assert core.weights_learned(None, 0.4)
    bid = core.submit(batch(), 0.4)
    assert core.batches[bid].weights_version == 2 and (core.weights.version, core.weights.path) == (2, P2)
    at_b = core.on_report(report("b", version=2, path=P2), 0.5)
    assert loads(at_b) == [] and loads(at_c) == []  # nobody is sent back to version 1


def test_a_fresh_router_stops_waiting_for_replicas_silent_for_a_replica_timeout():
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=3)
    core.on_report(report("a", **LAGGING), 0.1)
    timeout = core.fleet.replica_timeout_s
    assert not core.weights_learned(None, 0.1 + timeout / 2)
    assert core.weights_learned(None, 0.1 + timeout)  # the others are dead: their replacements start afresh


def _router(monkeypatch, learn_wait_s: float, replicas: int = 3):
    monkeypatch.setattr(router_module, "WEIGHTS_LEARN_WAIT_S", learn_wait_s)
    return Router.func_or_class(to_dict(ClusterConfig(replicas=replicas, engine=EngineConfig(kind="sim"))))


def test_the_serve_router_holds_a_new_routers_first_batch_until_the_fleet_spoke(monkeypatch):
    async def go():
        router = _router(monkeypatch, learn_wait_s=5.0)
        try:
            await pull(router, report("a", **LAGGING))
            submit = asyncio.ensure_future(router.submit_batch(batch(), 5.0))
            await asyncio.sleep(0.3)
            assert not submit.done()  # unpinned, and still it waits: b and c may hold newer weights
            for rid in ("b", "c"):
                router.core.on_report(report(rid, version=2, path=P2), time.monotonic())
            return await asyncio.wait_for(submit, 2.0)
        finally:
            router._reaper.cancel()

    answer = asyncio.run(go())
    assert answer["weights_version"] == 2


def test_the_serve_router_takes_the_batch_after_the_learning_wait_without_the_rest(monkeypatch):
    async def go():
        router = _router(monkeypatch, learn_wait_s=0.4)
        try:
            await pull(router, report("a", version=1, path=P1))
            t0 = time.monotonic()
            answer = await router.submit_batch(batch(), 30.0)
            return answer, time.monotonic() - t0
        finally:
            router._reaper.cancel()

    answer, waited = asyncio.run(go())
    assert answer["weights_version"] == 1 and 0.35 <= waited < 5.0  # the learning wait, then what it heard
