"""vLLM sleep mode through RouterCore (router/sleep.py, router/weights.py): between batches only,
one order to every replica (a joiner's at registration, a lost one again), no work and no
batches while asleep, and a wake that brings the current weights back."""
import pytest

from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.router.sleep import FleetSleep
from rollout_cluster.policy import make_policy
from rollout_cluster.router.core import RouterCore
from rollout_cluster.protocol import (EngineStats, InputError, LoadWeights, ModelInfo, NoteWeights, Report,
                                      SamplingSpec, SeqProgress, SequenceRequest, Sleep, SleepState, Wake,
                                      WeightsState)

COST = load_profile("h200-1.5b", max_num_seqs=8)


def pull(core, rid, now, level=0, goal=None, error=None, version=0, loading=0, path="", model=None, noted=(0, "")):
    goal = level if goal is None else goal
    return core.on_report(Report(rid, "i1", progress=[], stats=EngineStats(), model=model, capacity=8,
                                 weights=WeightsState(version=version, error=None, error_version=0,
                                                      loading=loading, path=path, noted=noted[0],
                                                      noted_path=noted[1]),
                                 sleep=SleepState(level=level, goal=goal, error=error)), now)


def core_with(replicas=("a", "b")):
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=len(replicas))
    for rid in replicas:
        pull(core, rid, 0.0, model=ModelInfo(100, 64))
    return core


def sleeps(orders):
    return [c for c in orders.control if isinstance(c, (Sleep, Wake))]


def batch(core, now=0.0, n=2):
    return core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=2), i, 0) for i in range(n)], now)


def asleep(core, level=1):
    """Both replicas got the order and sleep."""
    core.sleep_fleet(level)
    for rid in ("a", "b"):
        assert sleeps(pull(core, rid, 0.1)) == [Sleep(level)]
        pull(core, rid, 0.2, level=0, goal=level)  # moving
        pull(core, rid, 0.3, level=level)
    return core


def test_every_replica_gets_one_order_and_batches_wait_for_wake():
    core = core_with()
    assert core.sleep_fleet(1) == 1
    assert sleeps(pull(core, "a", 0.1)) == [Sleep(1)]
    assert sleeps(pull(core, "a", 0.2, level=0, goal=1)) == []  # moving: not ordered again
    assert core.sleep_status()["moving"] == ["a"]
    with pytest.raises(RuntimeError, match=r"asleep \(level 1, RolloutClient.sleep\): call wake\(\)"):
        batch(core)
    pull(core, "a", 0.3, level=1)
    assert sleeps(pull(core, "b", 0.4)) == [Sleep(1)]
    assert core.sleep_status() == {"level": 1, "replicas": {"a": 1, "b": 0}, "moving": [], "errors": {}}


def test_a_lost_order_is_sent_again_and_a_joiner_gets_it_at_registration():
    core = core_with()
    core.sleep_fleet(2)
    assert sleeps(pull(core, "a", 0.1)) == [Sleep(2)]  # this reply never arrives:
    assert sleeps(pull(core, "a", 0.2)) == [Sleep(2)]  # its next report still shows goal 0
    assert sleeps(pull(core, "c", 0.3, model=ModelInfo(100, 64))) == [Sleep(2)]


def test_no_work_while_waking_and_work_once_awake():
    core = asleep(core_with())
    core.wake_fleet()
    assert sleeps(pull(core, "a", 1.0, level=1)) == [Wake(None, 0)]
    bid = batch(core, now=1.1)  # the fleet's target is awake: batches are taken
    assert not pull(core, "a", 1.2, level=1, goal=0).start  # still waking: no work
    assert len(pull(core, "a", 1.3).start) == 2  # awake
    assert not pull(core, "b", 1.4, level=1).start  # b has its wake order, and no work
    assert bid in core.batches


def test_sleep_only_between_batches_and_one_level_at_a_time():
    core = core_with()
    bid = batch(core)
    with pytest.raises(RuntimeError, match=rf"sleep: 2 sequences of batch\(es\) {bid} are unfinished"):
        core.sleep_fleet(1)
    core.cancel(bid, 0.0)  # queued: they finish at once
    with pytest.raises(InputError, match=r"level=3: must be 1 \(offload the weights"):
        core.sleep_fleet(3)
    with pytest.raises(InputError, match=r"level=True"):
        core.sleep_fleet(True)
    asleep(core, 1)
    assert core.sleep_fleet(1) == 1  # the same level again: nothing to do
    with pytest.raises(RuntimeError, match="asleep at level 1 already; wake"):
        core.sleep_fleet(2)


def test_weights_updated_while_asleep_load_after_a_light_sleep_and_with_a_deep_wake():
    core = asleep(core_with(), 1)
    assert core.update_weights("/ckpt/step1") == 1
    out = pull(core, "a", 1.0, level=1)
    assert not [c for c in out.control if isinstance(c, LoadWeights)]  # asleep: no load, a note of it
    assert [c for c in out.control if isinstance(c, NoteWeights)] == [NoteWeights("/ckpt/step1", 1)]
    core.wake_fleet()
    assert sleeps(pull(core, "a", 1.1, level=1)) == [Wake("/ckpt/step1", 1)]
    loads = [c for c in pull(core, "a", 1.2, level=1, goal=0).control if isinstance(c, LoadWeights)]
    assert loads == []  # still waking
    loads = [c for c in pull(core, "a", 1.3).control if isinstance(c, LoadWeights)]
    assert loads == [LoadWeights("/ckpt/step1", 1)]  # awake at version 0: load
    # a level-2 sleeper reloads with its wake order and reports the version: no second load
    core2 = asleep(core_with(), 2)
    core2.update_weights("/ckpt/step7")
    core2.wake_fleet()
    assert sleeps(pull(core2, "a", 1.0, level=2)) == [Wake("/ckpt/step7", 1)]
    out = pull(core2, "a", 1.1, version=1, path="/ckpt/step7")
    assert not [c for c in out.control if isinstance(c, LoadWeights)]


def test_a_second_update_while_asleep_replaces_the_first_nothing_was_loading():
    core = asleep(core_with(), 1)
    core.update_weights("/ckpt/step1")
    assert core.update_weights("/ckpt/step2") == 2


def test_a_failed_sleep_is_reported_and_wake_clears_it():
    core = core_with()
    core.sleep_fleet(2)
    pull(core, "a", 0.1)
    pull(core, "a", 0.2, level=0, goal=2, error="replica a: sleep(level=2): no local checkpoint")
    st = core.sleep_status()
    assert st["errors"] == {"a": "replica a: sleep(level=2): no local checkpoint"} and st["moving"] == []
    assert sleeps(pull(core, "a", 0.3, level=0, goal=2, error="...")) == []  # failed: not ordered again
    core.wake_fleet()
    assert core.sleep_status()["errors"] == {}
    assert sleeps(pull(core, "a", 0.4, level=0, goal=2)) == [Wake(None, 0)]


def test_sleep_then_wake_before_the_replica_pulled_leaves_one_order():
    core = core_with()
    core.sleep_fleet(1)
    core.wake_fleet()
    assert sleeps(pull(core, "a", 0.1)) == [Wake(None, 0)]


def test_a_replica_that_leaves_is_forgotten():
    state = FleetSleep()
    state.set(1)
    state.record("a", 0, 1, "boom")
    state.forget("a")
    assert state.status() == {"level": 1, "replicas": {}, "moving": [], "errors": {}}


def test_a_batch_runs_after_wake():
    core = asleep(core_with(), 1)
    core.wake_fleet()
    for rid in ("a", "b"):
        pull(core, rid, 1.0, level=1)
        pull(core, rid, 1.1)
    bid = batch(core, now=1.2)
    work = {rid: pull(core, rid, 1.3).start for rid in ("a", "b")}
    assert [len(w) for w in work.values()] == [1, 1]  # both awake: the fair share each
    for rid, ws in work.items():
        core.on_report(Report(rid, "i1",
                              progress=[SeqProgress(w.seq_id, w.attempt, [5, 6], None, "length") for w in ws],
                              stats=EngineStats(), model=None, capacity=8), 1.4)
    done, _, finished = core.fetch(bid, 0)
    assert finished and [c.token_ids for c in done] == [[5, 6], [5, 6]]


def test_the_fleets_level_is_a_metric():
    from rollout_cluster.serve.metrics import PrometheusRouterMetrics

    metrics = PrometheusRouterMetrics(port=0)
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), 1, metrics=metrics)
    pull(core, "a", 0.0, model=ModelInfo(100, 64))
    core.sleep_fleet(2)
    metrics.gauges(core)
    assert metrics.registry.get_sample_value("rollout_sleep_level") == 2
    core.wake_fleet()
    metrics.gauges(core)
    assert metrics.registry.get_sample_value("rollout_sleep_level") == 0


def test_a_restarted_router_keeps_a_sleeping_fleet_asleep():
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=2)  # fresh: level 0
    assert sleeps(pull(core, "a", 0.0, level=1, model=ModelInfo(100, 64))) == []  # no wake order
    assert core.sleep_status()["level"] == 1
    with pytest.raises(RuntimeError, match="asleep"):
        batch(core)
    core.wake_fleet()
    assert sleeps(pull(core, "a", 0.1, level=1)) == [Wake(None, 0)]


def test_an_update_made_while_asleep_survives_a_router_restart():
    """The sleepers hold a note of it and report it: a restarted router takes it back as the
    current weights, and the wake loads it (regression: it woke the fleet on the old version)."""
    for level in (1, 2):
        core = asleep(core_with(), level)
        core.update_weights("/ckpt/step3", version=3)
        notes = {rid: [c for c in pull(core, rid, 1.0, level=level).control if isinstance(c, NoteWeights)]
                 for rid in ("a", "b")}
        assert notes == {rid: [NoteWeights("/ckpt/step3", 3)] for rid in ("a", "b")}
        assert not [c for c in pull(core, "a", 1.1, level=level, noted=(3, "/ckpt/step3")).control
                    if isinstance(c, NoteWeights)]  # it got the note: not sent again
        restarted = RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=2)
        for rid in ("a", "b"):
            pull(restarted, rid, 2.0, level=level, noted=(3, "/ckpt/step3"), model=ModelInfo(100, 64))
        assert restarted.weights_status()["version"] == 3 and restarted.sleep_status()["level"] == level
        restarted.wake_fleet()
        assert sleeps(pull(restarted, "a", 2.1, level=level, noted=(3, "/ckpt/step3"))) == [
            Wake("/ckpt/step3", 3)]
        if level == 1:  # awake on the weights it slept with: the load follows
            out = pull(restarted, "a", 2.2, noted=(3, "/ckpt/step3"))
            assert [c for c in out.control if isinstance(c, LoadWeights)] == [
                LoadWeights("/ckpt/step3", 3)]
        else:  # the wake order's reload brought it: nothing more
            out = pull(restarted, "a", 2.2, version=3, path="/ckpt/step3")
            assert not [c for c in out.control if isinstance(c, (LoadWeights, NoteWeights))]


def test_a_lost_note_is_sent_again():
    core = asleep(core_with(), 1)
    core.update_weights("/ckpt/step1")
    assert [type(c) for c in pull(core, "a", 1.0, level=1).control] == [NoteWeights]  # the reply is lost
    assert [type(c) for c in pull(core, "a", 1.1, level=1).control] == [NoteWeights]  # no note reported: again


def test_a_batch_is_refused_when_no_engine_woke():
    core = asleep(core_with(), 1)
    core.wake_fleet()
    for rid in ("a", "b"):
        pull(core, rid, 1.0, level=1)
        pull(core, rid, 1.1, level=1, goal=0, error=f"replica {rid}: wake: CUDA error: out of memory")
    with pytest.raises(RuntimeError, match=r"no engine woke: replica a: wake: CUDA .*\(wake\(\) again"):
        batch(core, now=1.2)
    pull(core, "a", 1.3)  # a woke after all: batches run on it
    assert batch(core, now=1.4)


def test_sleep_again_retries_only_the_replicas_that_failed():
    core = core_with()
    core.sleep_fleet(1)
    pull(core, "a", 0.1)
    pull(core, "a", 0.2, level=1)
    pull(core, "b", 0.1)
    pull(core, "b", 0.2, level=0, goal=1, error="replica b: sleep(level=1): RuntimeError: boom")
    assert core.sleep_status()["errors"] == {"b": "replica b: sleep(level=1): RuntimeError: boom"}
    assert core.sleep_fleet(1) == 1
    assert core.sleep_status()["errors"] == {}
    # b's report from before the order reached it still has the old error: not taken again
    error = "replica b: sleep(level=1): RuntimeError: boom"
    assert sleeps(pull(core, "b", 0.3, level=0, goal=1, error=error)) == [Sleep(1)]
    assert core.sleep_status()["errors"] == {}
    assert sleeps(pull(core, "a", 0.3, level=1)) == []


def test_wake_on_a_restarted_router_before_the_sleepers_report_is_not_lost():
    """A restarted router keeps a sleeping fleet asleep "until a driver calls wake()" (docs/
    architecture.md, Sleep mode). A driver whose wake() reaches the new router before the sleepers'
    first reports must still get an awake fleet: the wake is the driver's order, as a submitted
    batch is (FleetSleep.settle)."""
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=2)  # fresh: level 0
    core.wake_fleet()  # the trainer: wake() after its sleep, the router restarted in between
    for rid in ("a", "b"):
        out = pull(core, rid, 0.1, level=1, model=ModelInfo(100, 64))  # they were told level 1
        assert sleeps(out) == [Wake(None, 0)], f"replica {rid} was left asleep after wake()"
    assert core.sleep_status()["level"] == 0
    assert batch(core, now=0.2)  # not refused with "the engines are asleep ... call wake()"
