"""Weight updates through RouterCore: between batches only, a load order to every replica, no
work for a replica without the current weights, and every Completion tagged with its version."""
import pytest

from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.router.core import NoLiveReplicaError, RouterCore
from rollout_cluster.protocol import (EngineStats, InputError, LoadWeights, ModelInfo, Report, SamplingSpec,
                                      SeqProgress, SequenceRequest, WeightsState)

COST = load_profile("h200-1.5b", max_num_seqs=8)
MODEL = ModelInfo(100, 64)


def pull(core, rid, now, version=0, progress=(), error=None, model=None, error_version=None, loading=0, path=""):
    if error_version is None:
        error_version = core.weights.version
    return core.on_report(Report(rid, "i1", progress=list(progress), stats=EngineStats(), model=model, capacity=8,
                                 weights=WeightsState(version=version, error=error, error_version=error_version,
                                                      loading=loading, path=path)), now)


def core_with(replicas=("a", "b"), policy="pull"):
    core = RouterCore(make_policy(PolicyConfig(name=policy), COST), expected_replicas=len(replicas))
    for rid in replicas:
        pull(core, rid, 0.0, model=MODEL)
    return core


def batch(core, n=2, now=0.0):
    return core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=2), i, 0) for i in range(n)], now)


def ordered(core, path, *replicas):
    """update_weights(path), and each of `replicas` pulls once: it has its load order."""
    version = core.update_weights(path)
    for rid in replicas:
        assert loads(pull(core, rid, 0.1)) == [LoadWeights(path, version)]
    return version


def loads(orders):
    return [c for c in orders.control if isinstance(c, LoadWeights)]


def finish(core, rid, work, now, version):
    pull(core, rid, now, version, [SeqProgress(work.seq_id, work.attempt, [5, 6], None, "length")])


def test_every_replica_gets_one_load_order_and_no_work_until_it_holds_the_weights():
    core = core_with()
    assert core.update_weights("/ckpt/step1") == 1
    a = pull(core, "a", 0.1)
    assert loads(a) == [LoadWeights("/ckpt/step1", 1)]
    assert loads(pull(core, "a", 0.2, loading=1)) == []  # ordered once, not at every pull
    bid = batch(core, now=0.3)
    assert not pull(core, "a", 0.4, loading=1).start  # still loading: no work
    got_a = pull(core, "a", 0.5, version=1).start  # loaded: the fair share among loaded replicas: all
    b = pull(core, "b", 0.6)
    assert loads(b) == [LoadWeights("/ckpt/step1", 1)] and not b.start
    # b's next report shows neither the version nor a load of it: the order was lost, send it again
    assert loads(pull(core, "b", 0.65)) == [LoadWeights("/ckpt/step1", 1)]
    got_b = pull(core, "b", 0.7, version=1).start
    assert len(got_a) == 2 and not got_b
    for w in got_a:
        finish(core, "a", w, 0.8, 1)
    done, _, finished = core.fetch(bid, 0)
    assert finished and [c.weights_version for c in done] == [1, 1]
    assert core.weights_status() == {"version": 1, "path": "/ckpt/step1", "replicas": {"a": 1, "b": 1}, "held": ["a", "b"],
                                     "handed": {"a": {}, "b": {}}, "errors": {}, "broken": [],
                                     "streaming": False, "aborted": None}


def test_update_is_refused_while_a_batch_runs_and_versions_only_grow():
    core = core_with()
    bid = batch(core)
    with pytest.raises(RuntimeError, match=f"batch\\(es\\) {bid} are unfinished"):
        core.update_weights("/ckpt/step1")
    work = [("a", w) for w in pull(core, "a", 0.1).start] + [("b", w) for w in pull(core, "b", 0.1).start]
    assert len(work) == 2
    for rid, w in work:
        finish(core, rid, w, 0.2, 0)
    assert [c.weights_version for c in core.fetch(bid, 0)[0]] == [0, 0]
    assert core.update_weights("/ckpt/step5", version=5) == 5
    with pytest.raises(InputError, match="version=5: must be an integer above the current version 5"):
        core.update_weights("/ckpt/again", version=5)
    with pytest.raises(InputError, match="version=True"):
        core.update_weights("/ckpt/again", version=True)
    with pytest.raises(InputError, match="path=''"):
        core.update_weights("")
    with pytest.raises(InputError, match="path=None"):
        core.update_weights(None)
    assert core.weights.version == 5 and core.weights.path == "/ckpt/step5"


def test_a_replica_that_joins_later_loads_the_current_weights_first():
    core = core_with(("a",))
    ordered(core, "/ckpt/step1", "a")
    pull(core, "a", 0.2, version=1)
    c = core.on_report(Report("c", "i1", progress=[], stats=EngineStats(), model=MODEL, capacity=8,
                              weights=WeightsState(version=0)), 0.3)  # a restart: version 0
    assert loads(c) == [LoadWeights("/ckpt/step1", 1)]
    batch(core, now=0.4)
    assert not pull(core, "c", 0.5).start
    assert pull(core, "c", 0.6, version=1).start


def test_a_failed_load_is_reported_and_a_batch_with_no_loaded_replica_is_refused():
    core = core_with(("a", "b"))
    ordered(core, "/missing", "a", "b")
    pull(core, "a", 0.2, error="replica a: load_weights('/missing'): no such checkpoint directory")
    assert core.weights_status()["errors"] == {"a": "replica a: load_weights('/missing'): no such checkpoint directory"}
    pull(core, "b", 0.2, error="replica b: load_weights('/missing'): no such checkpoint directory")
    with pytest.raises(NoLiveReplicaError, match="no replica holds weights version 1 \\('/missing'\\): replica a"):
        batch(core, now=0.3)
    # a later update that succeeds clears the errors and the cluster serves again
    core.update_weights("/ckpt/good")
    assert core.weights_status()["errors"] == {}
    # the replica reports version 1's failure until it loads version 2: not an error of version 2
    stale = pull(core, "a", 0.4, error="replica a: load_weights('/missing'): ...", error_version=1)
    assert loads(stale) == [LoadWeights("/ckpt/good", 2)] and core.weights_status()["errors"] == {}
    pull(core, "a", 0.5, version=2)
    bid = batch(core, now=0.6)
    assert pull(core, "a", 0.7, version=2).start and not pull(core, "b", 0.7, version=0).start
    assert core.batches[bid].weights_version == 2


def test_a_loading_replicas_share_waits_for_it():
    """static gives each replica a fixed share; the share of a replica still loading waits."""
    core = core_with(("a", "b"), policy="static")
    ordered(core, "/ckpt/step1", "a")
    pull(core, "a", 0.15, version=1)
    bid = batch(core, n=4, now=0.2)
    a = pull(core, "a", 0.3, version=1)
    b = pull(core, "b", 0.3)
    assert len(a.start) == 2 and not loads(a)
    assert loads(b) == [LoadWeights("/ckpt/step1", 1)] and not b.start
    assert {w.seq_id for w in pull(core, "b", 0.4, version=1).start} == {f"{bid}:2", f"{bid}:3"}


def test_push_policies_cannot_give_work_to_a_replica_without_the_weights():
    """least-loaded assigns to every replica from one pull; a replica whose load failed is not one."""
    core = core_with(("a", "b"), policy="least-loaded")
    ordered(core, "/ckpt/step1", "a", "b")
    pull(core, "a", 0.2, version=1)
    pull(core, "b", 0.2, error="replica b: load_weights: bad checkpoint")
    bid = batch(core, n=4, now=0.3)
    a = pull(core, "a", 0.4, version=1)
    assert len(a.start) == 4 and not core.outbox.get("b")
    for w in a.start:
        finish(core, "a", w, 0.5, 1)
    done, _, finished = core.fetch(bid, 0)
    assert finished and {c.weights_version for c in done} == {1} and {tuple(c.replicas) for c in done} == {("a",)}


def test_errors_of_a_removed_replica_are_forgotten_and_a_success_clears_its_own():
    core = core_with(("a", "b"))
    ordered(core, "/ckpt/step1", "a", "b")
    pull(core, "a", 0.2, error="a failed")
    pull(core, "b", 0.2, error="b failed")
    assert set(core.weights_status()["errors"]) == {"a", "b"}
    core.remove_replica("b", 0.3)
    assert set(core.weights_status()["errors"]) == {"a"}
    core.update_weights("/ckpt/step2")
    pull(core, "a", 0.4, error="a failed", error_version=1)
    pull(core, "a", 0.5, version=2)
    assert core.weights_status()["errors"] == {}


def test_queued_work_fails_with_the_reasons_once_no_replica_can_hold_the_weights():
    """The batch was submitted while a replica still held the version; then every load failed."""
    core = core_with(("a",))
    ordered(core, "/ckpt/step1", "a")
    core.fleet.replicas["a"].weights_version = 1  # as if loaded, so that submit accepts the batch
    bid = batch(core, now=0.2)
    pull(core, "a", 0.3, error="replica a: load_weights('/ckpt/step1'): torn checkpoint")
    done, _, finished = core.fetch(bid, 0)
    assert finished and all(c.finish_reason == "error" and "torn checkpoint" in c.error for c in done)


def test_a_restarted_router_takes_the_version_the_replicas_hold():
    core = core_with(("a", "b"))  # a fresh router: version 0, no path
    a = pull(core, "a", 0.1, version=3, path="/ckpt/step3")
    assert core.weights.version == 3 and core.weights.path == "/ckpt/step3" and not loads(a)
    b = pull(core, "b", 0.1, version=0)  # b restarted too: it loads the same
    assert loads(b) == [LoadWeights("/ckpt/step3", 3)]
    bid = batch(core, now=0.2)
    assert pull(core, "a", 0.3, version=3, path="/ckpt/step3").start
    assert core.batches[bid].weights_version == 3


def test_a_dead_replicas_cancelled_sequences_end_as_abort_instead_of_running_again():
    core = core_with(("a", "b"))
    bid = batch(core)
    work = pull(core, "a", 0.1).start
    core.cancel(bid, 0.2)
    core.remove_replica("a", 0.3)
    done, _, finished = core.fetch(bid, 0)
    assert len(work) == 1 and finished and all(c.finish_reason == "abort" for c in done)
    core.update_weights("/ckpt/step1")  # nothing left unfinished


def test_a_second_update_while_the_first_still_loads_is_refused_until_it_settles():
    core = core_with()
    ordered(core, "/ckpt/step1", "a", "b")
    pull(core, "a", 0.2, version=1)  # a holds it; b is still loading
    with pytest.raises(RuntimeError, match=r"version 1 \('/ckpt/step1'\) is still loading on 1 replica\(s\) \(b\)"):
        core.update_weights("/ckpt/step2")
    pull(core, "b", 0.3, error="replica b: disk gone", error_version=1)  # b settles: it failed
    assert core.update_weights("/ckpt/step2") == 2  # a failed replica does not block the next update
