"""A batch that names its weights version (`weights_version`) runs on those weights or is refused
before anything runs: an RL step's samples all come from the policy the trainer meant. A new or
restarted router learns the fleet's version from its replicas' reports; the Serve router waits a
little for that before it refuses. The router class runs here without Serve."""
import asyncio
import time

import pytest

from rollout_cluster.config import ClusterConfig, EngineConfig, PolicyConfig, to_dict
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.router.core import RouterCore
from rollout_cluster.serve import router as router_module
from rollout_cluster.serve.router import Router
from router_support import pull
from rollout_cluster.protocol import (EngineStats, InputError, ModelInfo, Report, SamplingSpec, SeqProgress,
                                      SequenceRequest, WeightsState, WeightsVersionError)

COST = load_profile("h200-1.5b", max_num_seqs=8)


def report(rid: str, version: int = 0, path: str = "", progress=()) -> Report:
    return Report(rid, "i1", progress=list(progress), stats=EngineStats(), model=ModelInfo(1000, 4096), capacity=8,
                  weights=WeightsState(version=version, path=path))


def batch(n: int = 3) -> list:
    return [SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=4), i, 0) for i in range(n)]


def core_holding(version: int, path: str = "/ckpt") -> RouterCore:
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST))
    core.on_report(report("a"), 0.0)
    if version:
        core.update_weights(path, version)
        core.decide("a", 0.1)
        core.on_report(report("a", version, path), 0.2)
    return core


def run_to_end(core: RouterCore, bid: str) -> list:
    work = core.decide("a", 1.0).start
    core.on_report(report("a", core.weights.version, core.weights.path or "",
                          [SeqProgress(w.seq_id, w.attempt, [7] * 4, None, "length", offset=0) for w in work]), 1.1)
    new, _, done = core.fetch(bid, 0, 1.2)
    assert done
    return new


def test_a_batch_pinned_to_the_fleets_weights_runs_and_is_tagged_with_them():
    core = core_holding(3)
    bid = core.submit(batch(), 0.5, weights_version=3)
    assert [c.weights_version for c in run_to_end(core, bid)] == [3, 3, 3]
    # version 0 is the config's model, before any update
    fresh = core_holding(0)
    assert [c.weights_version for c in run_to_end(fresh, fresh.submit(batch(2), 0.5, weights_version=0))] == [0, 0]


def test_a_batch_pinned_to_other_weights_is_refused_before_anything_is_registered():
    core = core_holding(3, "/ckpt/step-3")
    for other in (2, 4):
        with pytest.raises(WeightsVersionError, match=rf"weights_version={other}: the fleet's weights are "
                                                      r"version 3 \('/ckpt/step-3'\): the batch was not run"):
            core.submit(batch(), 0.5, weights_version=other)
    assert not core.batches and not core.seqs and not core.queue
    assert issubclass(WeightsVersionError, InputError)  # names the field and the value, as every bad input


@pytest.mark.parametrize("bad", [-1, True, "3", 2.0])
def test_a_weights_version_that_is_no_version_names_the_field_and_the_value(bad):
    core = core_holding(0)
    with pytest.raises(InputError, match=rf"weights_version={bad!r}: must be an integer >= 0") as err:
        core.submit(batch(), 0.5, weights_version=bad)
    assert not isinstance(err.value, WeightsVersionError) and not core.batches


def test_a_new_router_learns_the_version_from_its_replicas_before_it_accepts_it():
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST))
    core.on_report(report("a"), 0.0)  # a replica on the config's model: 0 so far
    assert core.weights.learning_below(2) and not core.weights.learning_below(0)
    with pytest.raises(WeightsVersionError, match=r"version 0 \('the config model'\); this router is new \(or "
                                                  r"restarted\) and has learned it from 1 replica\(s\) so far"):
        core.submit(batch(), 0.1, weights_version=2)
    core.on_report(report("b", 2, "/ckpt/step-2"), 0.2)  # holds the latest update
    assert not core.weights.learning_below(2)
    bid = core.submit(batch(), 0.3, weights_version=2)
    assert core.batches[bid].weights_version == 2


def _router(monkeypatch, learn_wait_s: float):
    monkeypatch.setattr(router_module, "WEIGHTS_LEARN_WAIT_S", learn_wait_s)
    cfg = ClusterConfig(replicas=2, engine=EngineConfig(kind="sim"))
    return Router.func_or_class(to_dict(cfg))


def test_the_serve_router_waits_for_a_replica_that_holds_the_asked_version(monkeypatch):
    async def go():
        router = _router(monkeypatch, learn_wait_s=5.0)
        try:
            await pull(router, report("a"))  # the first replica back: config model
            submit = asyncio.ensure_future(router.submit_batch(batch(), 5.0, 2))
            await asyncio.sleep(0.3)
            assert not submit.done()  # it waits: other replicas may hold version 2
            router.core.on_report(report("b", 2, "/ckpt/step-2"), time.monotonic())
            return await asyncio.wait_for(submit, 2.0)
        finally:
            router._reaper.cancel()

    answer = asyncio.run(go())
    assert answer["weights_version"] == 2 and answer["batch_id"]


def test_the_serve_router_refuses_a_version_no_replica_reports_after_the_learning_wait(monkeypatch):
    async def go():
        router = _router(monkeypatch, learn_wait_s=0.4)
        try:
            await pull(router, report("a", 1, "/ckpt/step-1"))
            t0 = time.monotonic()
            with pytest.raises(WeightsVersionError, match=r"weights_version=7: the fleet's weights are version 1"):
                await router.submit(batch(), 30.0, 7)
            waited = time.monotonic() - t0
            unpinned = await router.submit_batch(batch(), 1.0)
            return waited, unpinned, router.core.batches
        finally:
            router._reaper.cancel()

    waited, unpinned, batches = asyncio.run(go())
    assert 0.35 <= waited < 5.0  # the learning wait, not the 30 s wait for a replica
    assert unpinned["weights_version"] == 1 and list(batches) == [unpinned["batch_id"]]


def test_a_refusal_survives_the_trip_from_the_router_to_the_driver():
    """Ray pickles what the router raises; the driver catches it by class (before __reduce__,
    InputError could not be unpickled, and the driver got a deserialization error instead)."""
    import pickle

    for error in (InputError("requests[3]", 7, "must be a SequenceRequest"),
                  WeightsVersionError("weights_version", 2, "the fleet's weights are version 3")):
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error) and str(back) == str(error) and back.field == error.field


def test_update_weights_waits_for_a_load_in_progress_before_it_orders_another():
    """A replacement replica that joined loads the current weights; the router would refuse a
    second load beside it, so the driver waits for it (found in CI: an update right after a
    replica was replaced failed)."""
    from rollout_cluster.client.client import RolloutClient

    calls = []

    def status(held: dict, version: int = 1) -> dict:
        return {"weights": {"version": version, "path": f"/ckpt/{version}", "replicas": held,
                            "held": [rid for rid, v in held.items() if v == version], "errors": {}},
                "sleep": {"level": 0}, "expected_replicas": 2, "live_sequences": 0}

    statuses = [status({"a": 1, "b": 0})] * 3 + [status({"a": 1, "b": 1})] * 2 + [status({"a": 2, "b": 2}, 2)] * 5

    class Handle:
        def __getattr__(self, name):
            def remote(*args):
                calls.append(name)
                value = statuses.pop(0) if name == "status" else 2
                return type("R", (), {"result": lambda self, timeout_s=None: value})()
            return type("M", (), {"remote": staticmethod(remote)})()

    client = object.__new__(RolloutClient)
    client.router, client.call_timeout_s, client.config = Handle(), 5.0, None
    assert client.update_weights("/ckpt/2", timeout_s=30) == 2
    # after the fourth status (b held version 1 by then) and a fifth (no sequence runs: running="finish")
    assert calls.index("update_weights") == 5
