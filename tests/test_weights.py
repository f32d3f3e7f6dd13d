"""Weight updates through RouterCore: between batches only, a load order to every replica, no
work for a replica without the current weights, and every Completion tagged with its version."""
import pytest

from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.router_core import NoLiveReplicaError, RouterCore
from rollout_cluster.types import EngineStats, InputError, ModelInfo, Report, SamplingSpec, SeqProgress, SequenceRequest

COST = load_profile("h200-1.5b", max_num_seqs=8)
MODEL = ModelInfo(100, 64)


def pull(core, rid, now, version=0, progress=(), error=None, model=None, error_version=None):
    if error_version is None:
        error_version = core.weights_version
    return core.on_report(Report(rid, "i1", list(progress), EngineStats(), model, 8, version, error, error_version), now)


def core_with(replicas=("a", "b"), policy="pull"):
    core = RouterCore(make_policy(PolicyConfig(name=policy), COST), expected_replicas=len(replicas))
    for rid in replicas:
        pull(core, rid, 0.0, model=MODEL)
    return core


def batch(core, n=2, now=0.0):
    return core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=2), i, 0) for i in range(n)], now)


def loads(orders):
    return [arg for cmd, arg in orders.control if cmd == "load_weights"]


def finish(core, rid, work, now, version):
    pull(core, rid, now, version, [SeqProgress(work.seq_id, work.attempt, [5, 6], None, "length")])


def test_every_replica_gets_one_load_order_and_no_work_until_it_holds_the_weights():
    core = core_with()
    assert core.update_weights("/ckpt/step1") == 1
    a = pull(core, "a", 0.1)
    assert loads(a) == [{"path": "/ckpt/step1", "version": 1}]
    assert loads(pull(core, "a", 0.2)) == []  # ordered once, not at every pull
    bid = batch(core, now=0.3)
    assert not pull(core, "a", 0.4).start  # still reports version 0: no work
    got_a = pull(core, "a", 0.5, version=1).start  # loaded: its fair share
    b = pull(core, "b", 0.6)
    assert loads(b) == [{"path": "/ckpt/step1", "version": 1}] and not b.start
    got_b = pull(core, "b", 0.7, version=1).start
    assert len(got_a) == len(got_b) == 1
    finish(core, "a", got_a[0], 0.8, 1)
    finish(core, "b", got_b[0], 0.8, 1)
    done, _, finished = core.fetch(bid, 0)
    assert finished and [c.weights_version for c in done] == [1, 1]
    assert core.weights_status() == {"version": 1, "path": "/ckpt/step1", "replicas": {"a": 1, "b": 1}, "errors": {}}


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
    assert core.weights_version == 5 and core.weights_path == "/ckpt/step5"


def test_a_replica_that_joins_later_loads_the_current_weights_first():
    core = core_with(("a",))
    core.update_weights("/ckpt/step1")
    pull(core, "a", 0.1)
    pull(core, "a", 0.2, version=1)
    c = core.on_report(Report("c", "i1", [], EngineStats(), MODEL, 8, 0), 0.3)  # a restart: version 0
    assert loads(c) == [{"path": "/ckpt/step1", "version": 1}]
    batch(core, now=0.4)
    assert not pull(core, "c", 0.5).start
    assert pull(core, "c", 0.6, version=1).start


def test_a_failed_load_is_reported_and_a_batch_with_no_loaded_replica_is_refused():
    core = core_with(("a", "b"))
    core.update_weights("/missing")
    pull(core, "a", 0.1)
    pull(core, "b", 0.1)
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
    assert loads(stale) == [{"path": "/ckpt/good", "version": 2}] and core.weights_status()["errors"] == {}
    pull(core, "a", 0.5, version=2)
    bid = batch(core, now=0.6)
    assert pull(core, "a", 0.7, version=2).start and not pull(core, "b", 0.7, version=0).start
    assert core.batches[bid].weights_version == 2


def test_a_loading_replicas_share_waits_for_it():
    """static gives each replica a fixed share; the share of a replica still loading waits."""
    core = core_with(("a", "b"), policy="static")
    core.update_weights("/ckpt/step1")
    pull(core, "a", 0.1)
    pull(core, "a", 0.15, version=1)
    bid = batch(core, n=4, now=0.2)
    a = pull(core, "a", 0.3, version=1)
    b = pull(core, "b", 0.3)
    assert len(a.start) == 2 and not loads(a)
    assert loads(b) == [{"path": "/ckpt/step1", "version": 1}] and not b.start
    assert {w.seq_id for w in pull(core, "b", 0.4, version=1).start} == {f"{bid}:2", f"{bid}:3"}
