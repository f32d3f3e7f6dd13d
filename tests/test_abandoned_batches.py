"""A batch whose driver died (no fetch for router.abandoned_batch_s) is cancelled and dropped:
its running sequences are given up, its queued ones never start, and its tokens leave the
router's memory. A driver that keeps fetching is never affected."""
import pytest

from rollout_cluster.config import ConfigError, PolicyConfig, load_config
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.router.core import RouterCore
from rollout_cluster.protocol import (EngineStats, ModelInfo, Report, SamplingSpec, SeqProgress, SequenceRequest,
                                      WeightsState)

COST = load_profile("h200-1.5b", max_num_seqs=2)


def report(rid, progress=(), model=None):
    return Report(rid, f"{rid}-1", progress=list(progress), stats=EngineStats(), model=model, capacity=2)


def batch(n, first=1):
    return [SequenceRequest([first, 2], SamplingSpec(max_tokens=8), i, 0) for i in range(n)]


@pytest.fixture
def core():
    c = RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=1, replica_timeout_s=1e9)
    c.on_report(report("a", model=ModelInfo(100, 64)), 0.0)
    return c


def test_an_unfetched_batch_is_cancelled_dropped_and_named_when_fetched_late(core):
    bid = core.submit(batch(3), 0.0)
    running = core.decide("a", 0.0).start  # 2 slots: two run, one stays queued
    assert len(running) == 2 and len(core.queue) == 1
    core.on_report(report("a", [SeqProgress(running[0].seq_id, running[0].attempt, [7, 8], offset=0)]), 1.0)
    assert core.drop_abandoned(100.0, idle_s=100.0) == []  # not yet: 100 s is not past 100 s
    assert core.drop_abandoned(100.5, idle_s=100.0) == [bid]
    assert bid not in core.batches and not any(k[0] == bid for k in core.batches.groups)
    assert len(core.queue) == 0  # the queued one never starts
    give_ups = core.decide("a", 100.5).give_up  # the running ones are given up
    assert sorted(give_ups) == sorted((w.seq_id, w.attempt) for w in running)
    # their aborts arrive after the batch is gone: nothing breaks, nothing is kept
    core.on_report(report("a", [SeqProgress(w.seq_id, w.attempt, [], None, "abort", offset=2 if i == 0 else 0)
                                for i, w in enumerate(running)]), 101.0)
    assert not core.seqs and not core.moves.give_up_t
    with pytest.raises(KeyError, match=r"dropped 100 s after submission: no fetch for 100 s .* 0 of 3"):
        core.fetch(bid, 0)


def test_a_batch_that_is_fetched_is_kept_however_long_it_runs(core):
    bid = core.submit(batch(3), 0.0)
    for t in range(10, 1000, 10):
        core.fetch(bid, 0, now=float(t))
        assert core.drop_abandoned(float(t) + 5, idle_s=30.0) == []
    assert bid in core.batches
    assert core.batches.status(1000.0)[bid] == {"size": 3, "finished": 0, "age_s": 1000.0, "unfetched_s": 10.0}


def test_a_finished_batch_nobody_collected_is_dropped_too_and_zero_means_never(core):
    bid = core.submit(batch(1), 0.0)
    (w,) = core.decide("a", 0.0).start
    core.on_report(report("a", [SeqProgress(w.seq_id, w.attempt, [3] * 8, None, "length")]), 1.0)
    assert core.fetch(bid, 0)[2] is True  # done, but its driver never called fetch(now=...) again
    assert core.drop_abandoned(5000.0, idle_s=0) == []
    assert core.drop_abandoned(5000.0, idle_s=900.0) == [bid] and "1 of 1" in core.batches.dropped[bid]


def test_the_other_batches_run_on(core):
    dead = core.submit(batch(2, first=1), 0.0)
    alive = core.submit(batch(2, first=5), 0.0)
    core.fetch(alive, 0, now=50.0)
    assert core.drop_abandoned(60.0, idle_s=30.0) == [dead]
    assert set(core.batches) == {alive}
    assert sorted(s.batch_id for s in core.seqs.values()) == [alive, alive]  # dead's were queued: gone
    assert not any(s.cancelled for s in core.seqs.values())
    assert all(w.seq_id.startswith(alive) for w in core.decide("a", 61.0).start)


def test_the_setting_is_checked():
    assert load_config({}).router.abandoned_batch_s == 900.0
    with pytest.raises(ConfigError, match="router.abandoned_batch_s=5"):
        load_config({"router": {"abandoned_batch_s": 5}})


def test_dropped_batches_and_weights_show_in_the_metrics():
    from rollout_cluster.serve.metrics import PrometheusRouterMetrics

    metrics = PrometheusRouterMetrics(port=0)
    c = RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=1, replica_timeout_s=1e9,
                   metrics=metrics)
    c.on_report(report("a", model=ModelInfo(100, 64)), 0.0)
    c.submit(batch(1), 0.0)
    c.submit(batch(1), 0.0)
    assert c.drop_abandoned(1000.0, idle_s=900.0) == ["b0", "b1"]
    c.update_weights("/ckpt/1")
    c.on_report(Report("a", "a-1", progress=[], stats=EngineStats(), model=None, capacity=2,
                       weights=WeightsState(version=0, error="replica a: no such file", error_version=1)), 1001.0)
    metrics.gauges(c)
    sample = metrics.registry.get_sample_value
    assert sample("rollout_batches_abandoned_total") == 2
    assert sample("rollout_weights_version") == 1 and sample("rollout_replicas_weights_failed") == 1


def test_a_cancelled_batch_its_driver_left_goes_sooner(core):
    bid = core.submit(batch(2), 0.0)
    core.decide("a", 0.0)
    core.cancel(bid, 10.0)  # the driver timed out, cancelled, raised: nobody fetches the aborts
    assert core.drop_abandoned(60.0, idle_s=900.0) == []
    assert core.drop_abandoned(61.0, idle_s=900.0) == [bid]
    with pytest.raises(KeyError, match=r"no fetch for 61 s \(cancelled, and 60 s is the wait for a cancelled batch\)"):
        core.fetch(bid, 0)
