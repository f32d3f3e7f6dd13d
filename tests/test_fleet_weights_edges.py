"""The router's fleet-wide weights state at three edges (weights.py, membership.py, dispatch.py):
a replica that dies before its load order reached it is no death in that load; a streamed push is
aborted when the last replica still loading it dies and every one left failed; a replica that held
the version before a break, registered again, loaded nothing and does not end the break."""
from rollout_cluster.protocol import EngineStats, LoadWeights, ModelInfo, Report, WeightsState

from test_fleet_sleep import batch, core_with, pull
from test_push_abort import SRC, at_checkpoint_then_streaming



def loads(orders):
    return [c for c in orders.control if isinstance(c, LoadWeights)]


def test_replicas_that_die_before_pulling_their_load_order_do_not_break_the_version():
    """update_weights leaves a LoadWeights in each replica's outbox; a and b die (silent, a replica
    timeout) before their next pull, so no engine ever saw the order. Their deaths say nothing of
    the checkpoint: their replacements must be ordered it, not held back as if it killed engines."""
    core = core_with(("a", "b"))
    for rid in ("a", "b"):
        pull(core, rid, 1.0)
    assert core.update_weights("/ck/1") == 1  # orders wait in the outbox: nobody pulled them
    assert sorted(core.expire(100.0)) == ["a", "b"]
    out = pull(core, "a2", 100.5, model=ModelInfo(100, 64))
    assert loads(out) == [LoadWeights("/ck/1", 1)], core.weights_status()["errors"]
    st = core.weights_status()
    assert st["broken"] == [] and st["errors"] == {}


def failed_push(core, rid, t):
    return core.on_report(Report(rid, "i1", progress=[], stats=EngineStats(), capacity=8, weights=WeightsState(
        version=1, path="/ck/1", error=f"replica {rid}: {SRC}: 2 of its 4 objects came, then none for 60 s",
        error_version=2, error_path=SRC)), t)


def test_a_streamed_push_is_aborted_when_the_last_replica_still_loading_it_dies():
    """Push v2 streams and its trainer dies (say, on the node that also ran replica b). a's load
    fails once the objects stop coming; b dies without a word. No live replica can ever hold v2
    and no trainer will abort it: the router aborts it itself (abort_unloadable_push), as it does
    when the last load fails, and a serves v1 again. It did so only on a failing report, never
    when a death left only failed replicas: a got no work until a replacement for b reported."""
    core = at_checkpoint_then_streaming()  # a loads the push; b's order waits ...
    assert loads(pull(core, "b", 1.0, version=1, path="/ck/1")) == [LoadWeights(SRC, 2, ("m", "b0"))]  # ... b's too
    failed_push(core, "a", 61.0)  # b may still load it: nothing aborted yet
    assert core.weights_status()["version"] == 2
    assert core.expire(62.0) == ["b"]  # b's last pull was at 1.0
    failed_push(core, "a", 62.5)
    st = core.weights_status()
    assert (st["version"], st["path"], st["streaming"]) == (1, "/ck/1", False), st
    assert st["aborted"] is not None and st["aborted"]["version"] == 2
    assert batch(core, now=63.0)  # a holds v1: it runs work again


def test_a_replica_that_held_the_version_before_its_break_coming_back_does_not_forget_the_break():
    """weights.py: "Replicas that held the version before the break say nothing of it". a held v1
    before b's load of it failed (the break); c, joining later, is held back. a is cut off for a
    replica timeout and pulls again (same incarnation): it registers anew, holding v1 as before.
    That is no load after the break: c must stay held back. It was taken for one (`just_loaded`
    on a fresh ReplicaState), the break forgotten, and c ordered the load that broke b."""
    core = core_with(("a", "b"))
    core.update_weights("/ck/1")
    pull(core, "a", 0.5)
    pull(core, "a", 0.6, version=1, path="/ck/1")
    pull(core, "b", 0.5)

    def b_failed(t):
        core.on_report(Report("b", "i1", progress=[], stats=EngineStats(), capacity=8, weights=WeightsState(
            version=0, error="replica b: load: CUDA error: illegal memory access", error_version=1,
            error_path="/ck/1")), t)

    b_failed(0.7)
    assert loads(pull(core, "c", 0.8, model=ModelInfo(100, 64))) == []  # held back
    for t in (30.0, 61.0):
        pull(core, "c", t)
        b_failed(t)
    assert core.expire(61.5) == ["a"]  # a, cut off, pulled last at 0.6
    pull(core, "a", 62.0, version=1, path="/ck/1")  # back, holding v1 as before the break
    assert [b["replica"] for b in core.weights_status()["broken"]] == ["b"]
    assert loads(pull(core, "c", 62.5)) == []
    assert "c" in core.weights_status()["errors"]
