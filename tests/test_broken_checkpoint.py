"""A checkpoint whose load failed on a replica is broken (router/weights.py): it is not ordered
again, not to the replica's replacement, not to a replica that joins or whose order was lost; the
replicas that hold the fleet's weights keep serving them; an update to that path is refused. A
replica that loads it after the break shows the failure was its own: the break is forgotten."""
import pytest

from rollout_cluster.protocol import EngineStats, InputError, LoadWeights, Report, WeightsState
from rollout_cluster.router.core import NoLiveReplicaError
from test_weights import MODEL, batch, core_with, finish, loads, ordered

BOOM = "replica a: load_weights('/ckpt/1'): WeightsLoadBroken: vLLM failed reloading, its weights are now unknown"


def report(core, rid, now, incarnation="i1", version=0, error=None, error_version=0, loading=0, progress=()):
    """A pull of incarnation `incarnation` of `rid` (a new one: Serve replaced the replica)."""
    return core.on_report(Report(rid, incarnation, progress=list(progress), stats=EngineStats(), model=MODEL,
                                 capacity=8, weights=WeightsState(version=version, error=error,
                                                                  error_version=error_version, loading=loading)), now)


def test_the_replacement_of_a_replica_a_checkpoint_broke_is_not_ordered_it_and_the_fleet_keeps_serving():
    core = core_with(("a", "b"))
    v = ordered(core, "/ckpt/1", "a", "b")
    report(core, "a", 0.2, version=v)
    report(core, "b", 0.2, version=v)
    # a dies; Serve's replacement loads the fleet's checkpoint, which breaks its engine
    assert loads(report(core, "a", 1.0, incarnation="i2")) == [LoadWeights("/ckpt/1", v)]
    report(core, "a", 1.1, incarnation="i2", error=BOOM, error_version=v)
    assert core.weights_status()["broken"] == [{"path": "/ckpt/1", "version": v, "replica": "a", "error": BOOM}]
    report(core, "b", 1.5, version=v)  # (b held it before the break: that says nothing of the break)
    # its health check fails, and Serve replaces it again: the replacement is not ordered the path
    again = report(core, "a", 2.0, incarnation="i3")
    assert loads(again) == [] and not again.start
    assert core.weights_status()["errors"] == {"a": f"replica a: not ordered '/ckpt/1' (version {v}): its load "
                                                     f"failed on replica a: {BOOM}"}
    assert loads(report(core, "a", 2.1, incarnation="i3")) == []  # nor at a later pull
    # b keeps serving the version the fleet had: a batch runs there, on it
    bid = batch(core, n=2, now=2.2)
    work = report(core, "b", 2.3, version=v).start
    assert len(work) == 2 and not report(core, "a", 2.3, incarnation="i3").start
    for w in work:
        finish(core, "b", w, 2.4, v)
    done, _, finished = core.fetch(bid, 0)
    assert finished and {c.weights_version for c in done} == {v} and {tuple(c.replicas) for c in done} == {("b",)}
    assert loads(report(core, "a", 2.5, incarnation="i3")) == [] and len(core.weights_status()["broken"]) == 1


def test_an_update_to_a_broken_path_is_refused_and_a_new_path_reaches_every_replica():
    core = core_with(("a", "b"))
    ordered(core, "/ckpt/1", "a", "b")
    report(core, "a", 0.2, error=BOOM, error_version=1)
    report(core, "b", 0.2, error="replica b: load_weights('/ckpt/1'): boom", error_version=1)
    with pytest.raises(NoLiveReplicaError, match="no replica holds weights version 1"):
        batch(core, now=0.3)
    with pytest.raises(InputError, match=r"path='/ckpt/1': its load as version 1 failed on replica a \(replica a: "
                                         r"load_weights.*not ordered again: write it under a new path"):
        core.update_weights("/ckpt/1")
    assert core.update_weights("/ckpt/1-again") == 2  # versions go on; the break stays listed
    assert loads(report(core, "a", 0.4, error=BOOM, error_version=1)) == [LoadWeights("/ckpt/1-again", 2)]
    assert loads(report(core, "b", 0.4)) == [LoadWeights("/ckpt/1-again", 2)]
    assert [b["path"] for b in core.weights_status()["broken"]] == ["/ckpt/1"]


def test_a_replica_that_joins_or_lost_its_order_is_held_back_and_counts_as_failed():
    core = core_with(("a", "b"))
    core.update_weights("/ckpt/1")
    assert loads(report(core, "a", 0.1)) == [LoadWeights("/ckpt/1", 1)]
    assert loads(report(core, "b", 0.1)) == [LoadWeights("/ckpt/1", 1)]
    report(core, "a", 0.2, error=BOOM, error_version=1)
    # b's reply was lost: it never loads, and its order is not sent again
    assert loads(report(core, "b", 0.3)) == [] and "not ordered '/ckpt/1'" in core.weights_status()["errors"]["b"]
    assert loads(report(core, "c", 0.3)) == []  # a replica that joins now
    assert set(core.weights_status()["errors"]) == {"a", "b", "c"}
    with pytest.raises(NoLiveReplicaError, match="no replica holds weights version 1 \\('/ckpt/1'\\): replica a"):
        batch(core, now=0.4)


def test_a_load_that_succeeds_after_the_break_shows_the_failure_was_the_replicas_own():
    core = core_with(("a", "b"))
    ordered(core, "/ckpt/1", "a", "b")
    report(core, "a", 0.2, error=BOOM, error_version=1)  # b is still loading
    assert loads(report(core, "a", 0.3, incarnation="i2")) == []  # a's replacement: held back
    report(core, "b", 0.4, version=1)  # b loaded it after the break
    assert core.weights_status()["broken"] == [] and core.weights_status()["errors"] == {}
    assert loads(report(core, "a", 0.5, incarnation="i2")) == [LoadWeights("/ckpt/1", 1)]
    bid = batch(core, n=2, now=0.6)
    assert report(core, "b", 0.7, version=1).start and core.batches[bid].weights_version == 1


def died_loading(core, rid, now, v, incarnation="i1"):
    from rollout_cluster.protocol import Report

    core.on_report(Report(rid, incarnation, stats=EngineStats(), model=MODEL, capacity=8, leaving=True,
                          engine_dead=True, weights=WeightsState(version=0, loading=v)), now)


def test_a_load_that_kills_two_replicas_is_broken_and_the_next_replacement_is_not_ordered_it():
    """Regression: an engine killed by a load (out of memory, a crash in vLLM's loader) says
    goodbye with no weights error, so nothing was broken: Serve's replacement was ordered the same
    load and died the same way, in a loop of restarts, while the driver waited out its timeout. One
    death may have another cause, and the replacement gets the version; a second is a break."""
    core = core_with(("a", "b"))
    v = ordered(core, "/ckpt/1", "a", "b")
    report(core, "b", 0.2, loading=v)
    died_loading(core, "b", 0.3, v)  # b's engine died in the load: once
    assert core.weights_status()["broken"] == []
    assert loads(report(core, "b", 1.0, incarnation="i2")) == [LoadWeights("/ckpt/1", v)]  # the replacement: ordered
    died_loading(core, "b", 1.1, v, incarnation="i2")  # and dies the same way
    assert core.weights_status()["broken"] == [{
        "path": "/ckpt/1", "version": v, "replica": "b",
        "error": f"replicas b, b died while loading version {v} (a load that kills engines is not ordered again)"}]
    again = report(core, "b", 2.0, incarnation="i3")  # the next replacement: held back, with the reason
    assert loads(again) == [] and "died while loading" in core.weights_status()["errors"]["b"]
    report(core, "a", 2.1, version=v)  # a loads it: the deaths were b's own; b gets its order
    assert core.weights_status()["broken"] == []
    assert loads(report(core, "b", 2.2, incarnation="i3")) == [LoadWeights("/ckpt/1", v)]


def test_a_replica_that_leaves_on_purpose_or_dies_holding_the_weights_counts_no_death():
    from rollout_cluster.protocol import Report

    core = core_with(("a", "b", "c"))
    v = ordered(core, "/ckpt/1", "a", "b")  # c has not pulled since: its order waits
    core.on_report(Report("a", "i1", stats=EngineStats(), model=MODEL, capacity=8, leaving=True,
                          weights=WeightsState(version=0, loading=v)), 0.3)  # scaled down mid-load
    report(core, "b", 0.3, version=v)
    core.on_report(Report("b", "i1", stats=EngineStats(), model=MODEL, capacity=8, leaving=True, engine_dead=True,
                          weights=WeightsState(version=v)), 0.4)  # died holding it: not during a load
    died_loading(core, "c", 0.5, v)  # c's one death during its load
    assert core.weights_status()["broken"] == [] and core.weights.load_deaths == {("/ckpt/1", v): ["c"]}
    assert loads(report(core, "c", 0.6, incarnation="i2")) == [LoadWeights("/ckpt/1", v)]
    report(core, "c", 0.7, incarnation="i2", version=v)  # it loads: the death was its own
    assert core.weights.load_deaths == {}
