"""Bad input to the batch-following calls is refused naming the field and value: it never hangs
or hands a completion back twice (a fetch cursor, the waits, hidden_lengths)."""
import asyncio
import math

import pytest

from rollout_cluster.client.expand import expand
from rollout_cluster.client.follower import BatchFollower
from rollout_cluster.config import ClusterConfig, EngineConfig, PolicyConfig, to_dict
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import (EngineStats, InputError, ModelInfo, Report, SamplingSpec, SeqProgress,
                                      SequenceRequest, WeightsState)
from rollout_cluster.router.core import RouterCore
from rollout_cluster.serve.router import Router

COST = load_profile("h200-1.5b", max_num_seqs=8)


def report(rid="a", progress=()):
    return Report(rid, "i1", progress=list(progress), stats=EngineStats(), model=ModelInfo(1000, 4096), capacity=8,
                  weights=WeightsState(version=0, path=""))


def batch(n=2):
    return [SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=4), i, 0) for i in range(n)]


def finished_batch():
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST))
    core.on_report(report(), 0.0)
    bid = core.submit(batch(2), 0.1)
    work = core.decide("a", 0.2).start
    core.on_report(report(progress=[SeqProgress(w.seq_id, w.attempt, [7] * 4, None, "length", offset=0)
                                    for w in work]), 0.3)
    first, cursor, done = core.fetch(bid, 0, 0.4)
    assert done and cursor == 2 and len(first) == 2
    return core, bid


@pytest.mark.parametrize("bad", [-1, -2, None, True])
def test_a_fetch_cursor_that_is_no_position_is_refused_not_answered_with_completions_again(bad):
    """A driver that fetches by itself (RolloutClient.submit + router.fetch) and sends a bad cursor
    gets completions it already holds again (-1: the last one, None: all of them)."""
    core, bid = finished_batch()
    with pytest.raises(InputError, match=rf"cursor={bad!r}: must be an integer from 0 to 2"):
        core.fetch(bid, bad, 0.5)


@pytest.mark.parametrize("bad", ["1", 1.5])
def test_a_fetch_cursor_of_the_wrong_type_names_the_field(bad):
    core, bid = finished_batch()
    with pytest.raises(InputError, match=rf"cursor={bad!r}: must be an integer"):
        core.fetch(bid, bad, 0.5)


def _serve_router():
    return Router.func_or_class(to_dict(ClusterConfig(replicas=1, engine=EngineConfig(kind="sim"))))


@pytest.mark.parametrize("bad", [float("nan"), "5"])
def test_submit_wait_for_replica_s_is_checked_and_never_hangs(bad):
    """No replica pulls yet: a NaN wait never passes its deadline (the router's submit spins for
    good, as lifecycle.connect's comment says of its own wait_s); a string fails with a bare TypeError."""
    async def go():
        router = _serve_router()
        try:
            with pytest.raises(InputError, match="wait_for_replica_s"):
                await asyncio.wait_for(router.submit_batch(batch(), bad), 3.0)
        finally:
            router._reaper.cancel()

    asyncio.run(go())


def test_the_follower_refuses_a_nan_wait_for_replica_s_before_submitting():
    """The driver's own bound on the submit call becomes call_timeout_s + NaN."""
    with pytest.raises(InputError, match="wait_for_replica_s"):
        f = BatchFollower(batch(), wait_for_replica_s=float("nan"))
        action = f.next(0.0)
        assert math.isfinite(f.submit_timeout_s(action))


def test_hidden_lengths_of_the_wrong_length_name_the_field():
    """generate(..., hidden_lengths=[...]) one short: a bare IndexError; one too many: silently dropped."""
    with pytest.raises(InputError, match="hidden_lengths"):
        expand([[1, 2], [3, 4]], SamplingSpec(max_tokens=4), hidden_lengths=[2])
    with pytest.raises(InputError, match="hidden_lengths"):
        expand([[1, 2], [3, 4]], SamplingSpec(max_tokens=4), hidden_lengths=[2, 3, 4])
