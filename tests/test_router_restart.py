"""A router that restarts mid-batch: the driver gets every sequence back once, in its place.

RolloutClient's own fetch loops (run_requests, stream) run here over a fake Serve handle whose
calls go to a RouterCore in this process, and whose "replica" finishes a few sequences per
fetch. A restart replaces the RouterCore with a new one under another id, as Serve does: the old
batch is gone, and the driver submits what it has not received again."""
import asyncio

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.serve._private.common import DeploymentID
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

from rollout_cluster.config import ClusterConfig, PolicyConfig, RouterConfig
from rollout_cluster.client.client import RolloutClient
from rollout_cluster.client.follower import BatchFollower, Cancel, Fail, Fetch, Pause, Submit
from rollout_cluster.client.loops import follow_batch, router_gone
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.router.core import RouterCore
from rollout_cluster.router.intake import NoLiveReplicaError
from rollout_cluster.protocol import (BatchLostError, Completion, EngineStats, InputError, Listing, ModelInfo, Report,
                                      SamplingSpec, SeqProgress, SequenceRequest, WeightsState, WeightsVersionError)

COST = load_profile("h200-1.5b", max_num_seqs=64)


class Call:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def result(self, timeout_s=None):
        return self.fn(*self.args)

    def __await__(self):
        async def run():
            return self.fn(*self.args)
        return run().__await__()


class Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        return Call(self.fn, *args)


class FakeRouter:
    """Serve's handle to a router in this process. Each fetch first lets the one replica finish
    `per_fetch` sequences (length = the request's max_tokens, token i of a sequence = i)."""

    def __init__(self, per_fetch: int = 3):
        self.per_fetch = per_fetch
        self.generation = 0
        self.before_fetch = []  # one callable is taken and run before each fetch: faults
        self.previous_ids = []  # each submission's previous_ids
        self.restart()
        self.submit, self.fetch, self.cancel = Method(self._submit), Method(self._fetch), Method(self._cancel)
        self.submit_batch = Method(self._submit_batch)

    def restart(self, weights: tuple = (0, "")) -> None:
        """A new router; its replica reports holding `weights` (version, path)."""
        self.generation += 1
        self.weights = weights
        self.core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), id_prefix=f"r{self.generation}-")
        self.now = 0.0
        self.report([], model=ModelInfo(1000, 4096))
        self.running = []

    def report(self, progress, model=None):
        self.now += 0.01
        version, path = self.weights
        held = [(w.seq_id, w.attempt) for w in getattr(self, "running", [])]  # the replica's listing
        return self.core.on_report(Report("a", f"inc{self.generation}", progress=progress, stats=EngineStats(),
                                          model=model, capacity=64,
                                          weights=WeightsState(version=version, path=path),
                                          listing=None if held is None else Listing(held, [])),
                                   self.now)

    def _submit(self, requests, wait_for_replica_s=None, weights_version=None, previous_ids=None):
        self.previous_ids.append(previous_ids)
        return self.core.submit(requests, self.now, weights_version=weights_version, previous_ids=previous_ids)

    def _submit_batch(self, requests, wait_for_replica_s=None, weights_version=None, previous_ids=None):
        bid = self._submit(requests, wait_for_replica_s, weights_version, previous_ids)
        return {"batch_id": bid, "weights_version": self.core.batches[bid].weights_version}

    def _cancel(self, batch_id):
        return self.core.cancel(batch_id, self.now)

    def _fetch(self, batch_id, cursor, wait_s):
        if self.before_fetch:
            self.before_fetch.pop(0)()
        self.running += self.core.decide("a", self.now).start
        done, self.running = self.running[:self.per_fetch], self.running[self.per_fetch:]
        self.report([SeqProgress(w.seq_id, w.attempt, list(range(w.sampling.max_tokens)), None, "length", offset=0)
                     for w in done])
        new, cursor, finished = self.core.fetch(batch_id, cursor, self.now)
        if finished:
            self.core.release(batch_id)
        return new, cursor, finished


def client_over(router) -> RolloutClient:
    client = object.__new__(RolloutClient)  # no Ray: the fake handle instead of Serve's
    client.router, client.app_name, client.timeout_s, client.call_timeout_s = router, "fake", 60.0, 5.0
    client.max_router_restarts, client.router_restarts, client.config = 3, 0, None
    return client


def requests(n: int) -> list:
    return [SequenceRequest([5, 6], SamplingSpec(max_tokens=4 + i % 5), i, 0) for i in range(n)]


def check_every_sequence_once_in_place(results, reqs):
    assert [c.index for c in results] == list(range(len(reqs)))
    assert [c.prompt_index for c in results] == [r.prompt_index for r in reqs]
    assert [c.token_ids for c in results] == [list(range(r.sampling.max_tokens)) for r in reqs]
    assert all(c.finish_reason == "length" for c in results)


def test_a_batch_another_router_made_is_lost_not_unknown():
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), id_prefix="new-")
    with pytest.raises(BatchLostError, match=r"batch_id='old-b0': made by another router.*restarted"):
        core.fetch("old-b0", 0)
    for not_lost in ("new-b7", "nope", "new-nope", "b3"):  # its own prefix, or no router's batch id at all
        with pytest.raises(KeyError, match="unknown batch") as err:
            core.fetch(not_lost, 0)
        assert not isinstance(err.value, BatchLostError)


def test_generate_resubmits_what_a_restarted_router_lost():
    router, reqs = FakeRouter(per_fetch=3), requests(20)
    router.before_fetch = [lambda: None] * 3 + [router.restart]  # 9 received, then the router goes
    client = client_over(router)
    results = client.run_requests(reqs)
    check_every_sequence_once_in_place(results, reqs)
    first = results[0].batch_id
    assert first.startswith("r1-") and sum(c.batch_id == first for c in results) == 9
    assert all(c.batch_id.startswith("r2-") for c in results if c.batch_id != first)
    assert client.router_restarts == 1 and client.last_batch_id.startswith("r2-")


def test_a_router_that_dies_under_the_fetch_is_waited_for():
    router, reqs = FakeRouter(per_fetch=4), requests(12)

    def die():
        router.restart()
        raise ActorDiedError()
    router.before_fetch = [lambda: None, die]
    client = client_over(router)
    results = client.run_requests(reqs)
    check_every_sequence_once_in_place(results, reqs)
    assert client.router_restarts == 1


def test_a_router_that_keeps_restarting_fails_the_batch_with_what_was_received():
    router, reqs = FakeRouter(per_fetch=2), requests(30)
    router.before_fetch = [router.restart] * 10
    client = client_over(router)
    client.max_router_restarts = 2
    with pytest.raises(BatchLostError, match=r"0 of 30 sequences were received.*again 2 times already "
                                             r"\(max_router_restarts\)"):
        client.run_requests(reqs)


def test_errors_that_are_not_a_restart_are_raised():
    router, reqs = FakeRouter(), requests(4)

    def boom():
        raise ValueError("not the router's death")
    router.before_fetch = [boom]
    with pytest.raises(ValueError, match="not the router's death"):
        client_over(router).run_requests(reqs)


def test_stream_yields_each_sequence_once_across_a_restart():
    router = FakeRouter(per_fetch=2)
    router.before_fetch = [lambda: None] * 2 + [router.restart]
    client = client_over(router)

    async def collect():
        return [c async for c in client.stream([[1, 2]] * 3, SamplingSpec(n=3, max_tokens=5))]
    out = asyncio.run(collect())
    assert sorted((c.prompt_index, c.sample_index) for c in out) == [(p, s) for p in range(3) for s in range(3)]
    assert sorted(c.index for c in out) == list(range(9)) and all(len(c.token_ids) == 5 for c in out)
    assert client.router_restarts == 1


def test_the_follower_places_completions_and_refuses_one_twice():
    reqs = requests(5)
    follow = BatchFollower(reqs)
    follow.submitted({"batch_id": "r1-b0", "weights_version": 0})
    follow.take([Completion(0, 0, [1], None, "length", index=0, finish_time_s=1.0)], 1)
    follow.fetch_failed(BatchLostError("gone"), now=5.0)
    again = follow.next(5.0).requests
    assert again == reqs[1:] and follow.positions == [1, 2, 3, 4]
    follow.submitted({"batch_id": "r2-b0", "weights_version": 0}, now=10.0)
    (c,) = follow.take([Completion(3, 0, [1], None, "length", index=2, finish_time_s=2.0)], 1)
    assert (c.index, c.finish_time_s) == (3, 12.0)  # its place, and seconds since the first submission
    with pytest.raises(RuntimeError, match="sequence 3 returned twice"):
        follow.take([Completion(3, 0, [1], None, "length", index=2)], 2)


def test_a_fetch_left_unanswered_is_asked_again_and_a_router_that_never_answers_fails_the_batch():
    router, reqs = FakeRouter(per_fetch=4), requests(8)

    def unanswered():
        raise TimeoutError("Timed out resolving to ObjectRef.")
    router.before_fetch = [lambda: None, unanswered, router.restart]
    client = client_over(router)
    check_every_sequence_once_in_place(client.run_requests(reqs), reqs)

    router.before_fetch = [unanswered] * 1000
    client.call_timeout_s = 0.6
    with pytest.raises(TimeoutError, match=r"the router has not answered for \d+ s .*call_timeout_s=0.6"):
        client.run_requests(reqs)


def test_a_resubmission_asks_for_the_weights_the_batch_ran_on():
    router, reqs = FakeRouter(per_fetch=3), requests(12)
    router.restart(weights=(2, "/ckpt/step-2"))
    router.before_fetch = [lambda: None, lambda: router.restart(weights=(2, "/ckpt/step-2"))]
    client = client_over(router)
    results = client.run_requests(reqs)
    check_every_sequence_once_in_place(results, reqs)
    assert {c.weights_version for c in results} == {2} and client.router_restarts == 1

    # The new router holds other weights (another driver's update_weights): the batch fails,
    # saying how much was received on which version, rather than mix two policies' samples.
    router.restart(weights=(2, "/ckpt/step-2"))
    router.before_fetch = [lambda: None, lambda: router.restart(weights=(3, "/ckpt/step-3"))]
    with pytest.raises(BatchLostError, match=r"3 of 12 sequences were received on weights version 2.*"
                                             r"weights_version=2: the fleet's weights are version 3 \('/ckpt/step-3'\): the batch was not run"):
        client.run_requests(reqs)

    async def collect():
        return [c async for c in client.stream([[1, 2]] * 4, SamplingSpec(n=2, max_tokens=5))]
    router.restart(weights=(2, "/ckpt/step-2"))
    router.before_fetch = [lambda: None, lambda: router.restart(weights=(3, "/ckpt/step-3"))]
    with pytest.raises(BatchLostError, match=r"received on weights version 2.*version 3"):
        asyncio.run(collect())


def test_a_batch_pinned_to_other_weights_is_refused_at_once_not_resubmitted():
    router, reqs = FakeRouter(), requests(4)
    router.restart(weights=(5, "/ckpt/step-5"))
    client = client_over(router)
    with pytest.raises(WeightsVersionError, match=r"weights_version=4: the fleet's weights are version 5"):
        client.run_requests(reqs, weights_version=4)
    assert not router.core.batches and client.router_restarts == 0
    results = client.run_requests(reqs, weights_version=5)
    assert [c.weights_version for c in results] == [5] * 4


def test_follow_batch_cancels_a_batch_past_its_timeout():
    """The follower the HTTP route and stream share: past timeout_s the batch is cancelled, so
    its sequences stop taking engine time, and TimeoutError names how far it got."""
    router, reqs = FakeRouter(per_fetch=1), requests(6)

    async def follow():
        got = []
        with pytest.raises(TimeoutError, match=r"of 6 sequences done after 0.3 s \(timeout_s\); the batch was cancelled"):
            async for c in follow_batch(router, reqs, timeout_s=0.3, call_timeout_s=5.0):
                got.append(c)
                await asyncio.sleep(0.1)
        return got
    got = asyncio.run(follow())
    (batch,) = router.core.batches.values()
    assert batch.cancelled and 1 <= len(got) < 6
    left = [s for s in router.core.seqs.values() if s.batch_id == batch.batch_id]
    assert left and all(s.cancelled for s in left)  # the rest stop, not left to run


def test_a_resubmission_names_each_sequences_id_under_the_lost_router():
    """So that the new router can hand it what the old one's segment generated (router/adoption.py)."""
    router, reqs = FakeRouter(per_fetch=3), requests(10)
    router.before_fetch = [lambda: None, router.restart, lambda: None, router.restart]
    results = client_over(router).run_requests(reqs)
    check_every_sequence_once_in_place(results, reqs)
    first, second, third = router.previous_ids
    assert first is None
    # 3 received from r1's batch (its indices 0-2): the other 7, by their index there
    assert second == [f"r1-b0:{i}" for i in range(3, 10)]
    # r2's batch held places 3-9 at its indices 0-6, and 3 more came back from it: 3 + 3 received
    assert third == [f"r2-b0:{i}" for i in range(3, 7)]
    assert [c.batch_id for c in results] == ["r1-b0"] * 3 + ["r2-b0"] * 3 + ["r3-b0"] * 4


def test_the_follower_says_what_to_do_next_and_does_none_of_it():
    """The sans-I/O follower alone: events in (answers, errors, the time), actions out."""
    reqs = requests(4)
    follow = BatchFollower(reqs, timeout_s=10.0, call_timeout_s=2.0, finish_fraction=0.5)
    first = follow.next(100.0)
    assert isinstance(first, Submit) and first.requests == reqs and first.previous_ids is None and not first.restart
    follow.submitted({"batch_id": "r1-b0", "weights_version": 3}, 100.1)
    assert follow.next(100.2) == Fetch("r1-b0", 0)
    follow.take([Completion(i, 0, [1], None, "length", index=i) for i in (0, 1)], 2)
    assert follow.next(100.3) == Cancel("r1-b0", "cut")  # half of the samples came back
    follow.cancelled(True)
    assert follow.next(100.4) == Fetch("r1-b0", 2)
    follow.fetch_failed(ActorDiedError(), 100.5, router_gone=True)
    assert follow.next(100.5) == Pause(0.5)  # Serve starts a new router meanwhile
    follow.fetch_failed(BatchLostError("gone"), 101.0)
    again = follow.next(101.0)
    assert again.restart and again.requests == reqs[2:] and again.weights_version == 3
    assert again.previous_ids == ["r1-b0:2", "r1-b0:3"]
    follow.submitted({"batch_id": "r2-b0", "weights_version": 3}, 101.1)
    assert follow.next(109.5) == Fetch("r2-b0", 0)
    assert follow.next(110.6) == Cancel("r2-b0", "timeout")  # 10 s after the first submission
    follow.cancelled(False)  # the batch fails whether the cancel worked or not
    failed = follow.next(110.7)
    assert isinstance(failed, Fail) and isinstance(failed.error, TimeoutError)
    assert str(failed.error) == "batch r2-b0: 2 of 4 sequences done after 10 s (timeout_s); the batch was cancelled"


@pytest.mark.parametrize("error", [ReplicaUnavailableError("rollout#Router#r1"),
                                   DeploymentUnavailableError(DeploymentID("Router", "rollout")),
                                   ActorUnavailableError("restarting", None), TimeoutError("no answer")],
                         ids=lambda e: type(e).__name__)
def test_a_fetch_that_finds_no_router_replica_waits_for_serves_new_one(error):
    """Regression: the drivers' follow loop counted only RayActorError and timeouts as "no router"
    (client/loops.router_gone), while the Gateway's routes (serve/router_reach) also counted Serve's
    ReplicaUnavailableError and DeploymentUnavailableError. A fetch that raised one of those while
    Serve held no router replica failed the whole batch at once; now it waits for the new router,
    for call_timeout_s at most, as a router that died under the call does."""
    follow = BatchFollower(requests(2), timeout_s=60.0, call_timeout_s=2.0)
    follow.next(100.0)
    follow.submitted({"batch_id": "r1-b0", "weights_version": 0}, 100.1)
    assert follow.next(100.2) == Fetch("r1-b0", 0)
    assert router_gone(error)
    follow.fetch_failed(error, 100.3, router_gone(error))
    assert follow.next(100.3) == Pause(0.5)
    follow.fetch_failed(error, 102.4, router_gone(error))  # past call_timeout_s: the batch fails, naming it
    failed = follow.next(102.4)
    assert isinstance(failed, Fail) and isinstance(failed.error, TimeoutError) and str(error) in str(failed.error)


def test_an_error_of_the_router_itself_is_not_taken_for_a_missing_router():
    assert not router_gone(ValueError("batch_id: no such batch"))


@pytest.mark.parametrize("fault", [KeyboardInterrupt, ValueError], ids=["ctrl-c", "an error"])
def test_a_blocking_generate_that_stops_before_the_end_cancels_its_batch(fault):
    """Regression: run_sync (generate, run_requests, the JSONL runner) left its batch running when
    it stopped before the end: Ctrl-C in a notebook or a trainer, or a fetch error raised to the
    caller. The router ran the rest of the batch for nobody until router.abandoned_batch_s (900 s),
    beside the caller's next batch. The async driver cancels in that case; the sync one does now."""
    router, reqs = FakeRouter(per_fetch=2), requests(10)

    def stop():
        raise fault("stopped")
    router.before_fetch = [lambda: None, stop]
    with pytest.raises(fault):
        client_over(router).run_requests(reqs)
    (batch,) = router.core.batches.values()
    assert batch.cancelled and len(batch.order) < 10
    assert all(s.cancelled for s in router.core.seqs.values() if s.batch_id == batch.batch_id)


def test_a_batch_that_timed_out_is_cancelled_once():
    router, reqs = FakeRouter(per_fetch=0), requests(3)
    calls = []
    cancel = router.cancel.fn
    router.cancel = Method(lambda bid: calls.append(bid) or cancel(bid))
    client = client_over(router)
    with pytest.raises(TimeoutError, match="the batch was cancelled"):
        client.run_requests(reqs, timeout_s=0.05)
    assert len(calls) == 1


class SlowSubmitRouter(FakeRouter):
    """A router with no replica yet: its submit waits for one (Router.submit: `wait_for_replica_s`,
    else router.submit_wait_for_replica_s, 600 s by default) and makes the batch once one comes,
    `replica_in_s` after the call; a driver that stops waiting first gets TimeoutError, as from
    Serve's DeploymentResponse.result, and the batch is made all the same."""

    def __init__(self, replica_in_s: float):
        super().__init__()
        self.replica_in_s, self.bounds = replica_in_s, []
        self.submit_batch = Method(None)
        self.submit_batch.remote = self._slow_submit

    def _slow_submit(self, requests, wait_for_replica_s=None, weights_version=None, previous_ids=None):
        router = self

        class Slow(Call):
            def result(self, timeout_s=None):
                router.bounds.append(timeout_s)
                wait = 600.0 if wait_for_replica_s is None else wait_for_replica_s
                if router.replica_in_s > wait:
                    raise NoLiveReplicaError(f"no live engine replica after {wait:.0f} s")
                answer = router._submit_batch(requests, wait_for_replica_s, weights_version, previous_ids)
                if timeout_s is not None and router.replica_in_s > timeout_s:
                    raise TimeoutError("Timed out resolving to ObjectRef.")
                return answer

            def __await__(self):
                async def run():
                    return self.result(None)
                return run().__await__()
        return Slow(None)


def test_a_submit_waits_as_long_as_the_router_waits_for_a_replica():
    """Regression: the router waits for a live replica up to router.submit_wait_for_replica_s
    (600 s) when the submit names no wait, but the drivers gave the call only call_timeout_s
    (120 s). A batch submitted while the engines were still starting (a RayService loading a big
    model, a fleet Serve is replacing) failed at 120 s with a bare TimeoutError, and the router
    made it once a replica came: it ran for nobody until router.abandoned_batch_s. Now a driver
    waits for the router's own answer (the batch, or its NoLiveReplicaError)."""
    router, reqs = SlowSubmitRouter(replica_in_s=200.0), requests(4)
    client = client_over(router)
    client.call_timeout_s, client.timeout_s = 120.0, 3600.0  # (a batch's timeout_s bounds the wait too: below)
    check_every_sequence_once_in_place(client.run_requests(reqs), reqs)
    assert router.bounds == [720.0]  # call_timeout_s + the router's wait
    assert len(router.core.batches) == 0  # fetched whole and released: none left behind
    client.config = ClusterConfig(router=RouterConfig(submit_wait_for_replica_s=1800.0))
    check_every_sequence_once_in_place(client.run_requests(reqs), reqs)
    assert router.bounds[-1] == 1920.0  # the client's config says how long its router waits
    check_every_sequence_once_in_place(client.run_requests(reqs, wait_for_replica_s=300.0), reqs)
    assert router.bounds[-1] == 420.0  # a wait named by the caller is the router's wait
    # the async driver (stream, the Gateway) bounds its submit by the same rule
    follow = BatchFollower(reqs, call_timeout_s=120.0)
    assert follow.submit_timeout_s(follow.next(0.0)) == 720.0
    follow = BatchFollower(reqs, call_timeout_s=120.0, wait_for_replica_s=5.0, router_wait_s=1800.0)
    assert follow.submit_timeout_s(follow.next(0.0)) == 125.0
    client.submit(reqs)  # a submit that the caller fetches by itself: the same bound
    assert router.bounds[-1] == 1920.0
    # a batch that may take less than the router's wait asks it to wait no longer
    follow = BatchFollower(reqs, timeout_s=30.0, call_timeout_s=120.0)
    first = follow.next(0.0)
    assert first.wait_for_replica_s == 30.0 and follow.submit_timeout_s(first) == 150.0


def test_a_batch_timeout_of_zero_is_refused_not_taken_for_the_default():
    """Regression: generate, run_requests and stream read `timeout_s or client.timeout_s`, so
    timeout_s=0 (no wait at all) silently became the client's hour; it is refused as -1 is."""
    router = FakeRouter()
    client = client_over(router)
    for bad in (0, 0.0, -1):
        with pytest.raises(InputError, match=r"^timeout_s=.*: must be a finite number of seconds > 0"):
            client.run_requests(requests(2), timeout_s=bad)

        async def collect():
            return [c async for c in client.stream([[1, 2]], SamplingSpec(max_tokens=3), timeout_s=bad)]
        with pytest.raises(InputError, match=r"^timeout_s="):
            asyncio.run(collect())
    assert not router.core.batches


def test_an_empty_batch_is_not_submitted():
    """Regression: generate([]) (a step whose prompts were all filtered out) submitted an empty
    batch: the router waited for a live replica for it (up to router.submit_wait_for_replica_s),
    and held it, never fetched, in status()["batch_ids"] until router.abandoned_batch_s."""
    router = FakeRouter()
    client = client_over(router)
    assert client.generate([], SamplingSpec(max_tokens=3)) == [] and client.run_requests([]) == []

    async def collect():
        return [c async for c in client.stream([], SamplingSpec(max_tokens=3))]
    assert asyncio.run(collect()) == []
    assert not router.core.batches and router.previous_ids == []
