"""Scheduling policies and how the router applies them, at their edges: chunked's first round
starts on the replicas that woke (one whose wake failed is not waited for), chunked runs a pinned
sequence whole, and steal's tail-isolation estimate of a large group computes only the quantiles
it needs (a table of every (size, finished) pair was size^2)."""
import numpy as np
import pytest

from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import estimate, make_policy
from rollout_cluster.protocol import (EngineStats, ModelInfo, Report, SamplingSpec, SequenceRequest, SleepState,
                                      WeightsState)
from rollout_cluster.router.core import RouterCore

COST = load_profile("h200-1.5b", max_num_seqs=8)
MODEL = ModelInfo(100, 64)


def _pull(core, rid, now, level=0, goal=None, error=None, model=None):
    goal = level if goal is None else goal
    return core.on_report(Report(rid, "i1", progress=[], stats=EngineStats(), model=model, capacity=8,
                                 weights=WeightsState(version=0, error=None, error_version=0, loading=0, path="",
                                                      noted=0, noted_path=""),
                                 sleep=SleepState(level=level, goal=goal, error=error)), now)


def _fleet_where_b_did_not_wake(policy):
    """Two replicas sleep; the fleet wakes; a wakes, b's wake fails and it stays asleep (still pulling)."""
    core = RouterCore(make_policy(PolicyConfig(name=policy), COST), expected_replicas=2, replica_timeout_s=60.0)
    for rid in ("a", "b"):
        _pull(core, rid, 0.0, model=MODEL)
    core.sleep_fleet(1)
    for rid in ("a", "b"):
        _pull(core, rid, 0.1)
        _pull(core, rid, 0.2, level=0, goal=1)
        _pull(core, rid, 0.3, level=1)
    core.wake_fleet()
    for rid in ("a", "b"):
        _pull(core, rid, 0.9, level=1)
    _pull(core, "a", 1.0, level=0)
    _pull(core, "b", 1.0, level=1, goal=0, error="CUDA out of memory while waking")
    assert core.sleep_status()["errors"] == {"b": "CUDA out of memory while waking"}
    return core


@pytest.mark.parametrize("policy", ["pull", "chunked"])
def test_a_batch_starts_on_the_replica_that_woke_when_another_failed_to_wake(policy):
    core = _fleet_where_b_did_not_wake(policy)
    core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=2), i, 0) for i in range(4)], 1.5)
    started = []
    for t in range(2, 200, 2):  # b keeps pulling (alive, asleep): well past a replica timeout
        started += _pull(core, "a", float(t)).start
        _pull(core, "b", float(t), level=1, goal=0, error="CUDA out of memory while waking")
        core.expire(float(t))
        if started:
            break
    assert len(started) == 4, f"{policy}: nothing started in 200 s with one engine awake (expected replicas " \
                              f"{core.fleet.expected}, usable 1)"


def test_chunked_does_not_cut_a_pinned_sequence():
    core = RouterCore(make_policy(PolicyConfig(name="chunked", chunk_tokens=16), COST), expected_replicas=1)
    _pull(core, "a", 0.0, model=MODEL)
    pinned = SamplingSpec(max_tokens=40, presence_penalty=0.5)
    assert not pinned.migratable
    core.submit([SequenceRequest([1, 2], pinned, 0, 0), SequenceRequest([1, 2], SamplingSpec(max_tokens=40), 1, 0)],
                0.1)
    works = {w.seq_id: w for w in _pull(core, "a", 0.2).start}
    assert len(works) == 2
    seqs = {sid: core.seqs[sid] for sid in works}
    pinned_work = next(w for sid, w in works.items() if not seqs[sid].migratable)
    free_work = next(w for sid, w in works.items() if seqs[sid].migratable)
    assert free_work.stop_after == 16  # the round's cut, for a sequence that may continue elsewhere
    assert pinned_work.stop_after is None, (
        f"a pinned sequence is cut after {pinned_work.stop_after} tokens: it would continue with its output "
        "as prompt, unpenalised")


def test_tail_isolation_estimate_of_a_large_group_does_not_build_a_quadratic_table(monkeypatch):
    """One sequence of a 5000-sample group: its estimate needs one quantile, not 25 million."""
    calls = {"n": 0}
    real = estimate._phi_inv

    def counted(p):
        calls["n"] += 1
        if calls["n"] > 50_000:
            raise AssertionError("more than 50000 quantiles computed for one estimate of one group")
        return real(p)

    monkeypatch.setattr(estimate, "_phi_inv", counted)
    monkeypatch.setattr(estimate, "_QUANTILES", {})
    g, cap = np.array([100.0]), np.array([4096.0])
    size, finished = np.array([5000.0]), np.array([5.0])
    got = estimate.expected_remaining_array(g, cap, size, finished, 500.0)
    want = estimate.lognormal_remaining(100.0, np.log(125.0) - estimate.GROUP_SIGMA * real(5.5 / 5001.0),
                                        estimate.GROUP_SIGMA, 4096.0)
    assert got[0] == pytest.approx(want, rel=1e-3)
