"""A pull whose reply never reaches the replica (the router applied the report and answered, the
answer was lost): the replica sends the same deltas again, and later lists what it holds. No token
is counted twice, and work the lost reply carried runs again; nothing is lost."""
import pytest

from rollout_cluster.client.follower import BatchFollower, Done, Fetch, Pause
from rollout_cluster.config import ConfigError, PolicyConfig, load_config
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.engines.sim_core import SimEngineCore
from rollout_cluster.policy import make_policy
from rollout_cluster.router.core import RouterCore
from rollout_cluster.protocol import (Completion, EngineStats, Listing, ModelInfo, Report, SamplingSpec, SeqProgress,
                                      SequenceRequest)

COST = load_profile("h200-1.5b", max_num_seqs=8)


def report(progress=(), held=None, model=None, aborting=()):
    return Report("a", "i1", progress=list(progress), stats=EngineStats(), model=model, capacity=8,
                  listing=None if held is None else Listing(held, list(aborting)))


def setup(n=2, max_tokens=6):
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=1)
    core.on_report(report(model=ModelInfo(100, 64)), 0.0)
    bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=max_tokens), i, 0) for i in range(n)], 0.0)
    return core, bid


def test_a_report_sent_again_after_a_lost_reply_counts_its_tokens_once():
    core, bid = setup(n=1)
    (work,) = core.decide("a", 0.0).start
    delta = SeqProgress(work.seq_id, work.attempt, [7, 8], offset=0)
    core.on_report(report([delta]), 0.1)  # applied; its reply is lost, so the replica keeps the delta
    later = SeqProgress(work.seq_id, work.attempt, [9, 10, 11, 12], None, "length", offset=2)
    core.on_report(report([delta, later]), 0.2)  # the retry carries it again, then the rest
    done, _, finished = core.fetch(bid, 0)
    assert finished and done[0].token_ids == [7, 8, 9, 10, 11, 12]
    assert core.counters.duplicate_reports == 1 and core.counters.generated_tokens == 6


def test_work_in_a_lost_reply_runs_again_once_the_replica_lists_what_it_holds():
    core, bid = setup(n=2)
    lost = core.decide("a", 0.0).start  # this reply never arrives
    assert len(lost) == 2
    again = core.on_report(report(held=[]), 0.1).start  # "I hold nothing": both go out again
    assert [(w.seq_id, w.attempt) for w in again] == [(w.seq_id, w.attempt + 1) for w in lost]
    assert core.counters.lost_orders == 2
    # the new attempts are held; the replica lists them and nothing moves
    assert not core.on_report(report(held=[(w.seq_id, w.attempt) for w in again]), 0.2).start
    for w in again:
        core.on_report(report([SeqProgress(w.seq_id, w.attempt, [5] * 6, None, "length", offset=0)]), 0.3)
    done, _, finished = core.fetch(bid, 0)
    assert finished and [len(c.token_ids) for c in done] == [6, 6] and core.counters.lost_orders == 2


def test_work_in_the_reply_being_answered_is_not_taken_for_lost():
    """The list comes with the pull that the new work answers: the replica has not seen it yet."""
    core, _ = setup(n=1)
    orders = core.on_report(report(held=[]), 0.1)
    assert len(orders.start) == 1 and core.counters.lost_orders == 0


def test_a_lost_reply_mid_segment_resumes_from_the_last_reported_tokens():
    core, bid = setup(n=1, max_tokens=6)
    (work,) = core.decide("a", 0.0).start
    core.on_report(report([SeqProgress(work.seq_id, work.attempt, [7, 8], offset=0)]), 0.1)
    # the engine then lost the request (a replica that restarted its engine, say) and says so
    (again,) = core.on_report(report(held=[]), 0.2).start
    assert again.attempt == work.attempt + 1 and again.prompt_token_ids == [1, 2, 7, 8]
    assert again.sampling.max_tokens == 4
    core.on_report(report([SeqProgress(again.seq_id, again.attempt, [9, 10, 11, 12], None, "length", offset=0)]), 0.3)
    assert core.fetch(bid, 0)[0][0].token_ids == [7, 8, 9, 10, 11, 12]


def test_the_engines_number_their_deltas():
    """SimEngineCore (the real-time sim replica) gives each delta the tokens reported before it."""
    core, _ = setup(n=1, max_tokens=6)
    (work,) = core.decide("a", 0.0).start
    eng = SimEngineCore(COST)
    eng.submit(work)
    eng.advance(max_steps=2)
    first = eng.drain()
    eng.advance()
    rest = eng.drain()
    assert [(p.offset, p.num_tokens) for p in first + rest] == [(0, 2), (2, 4)]


def test_the_sim_replica_lists_what_it_holds():
    from rollout_cluster.engines.sim_engine import SimEngine

    core, _ = setup(n=2)
    works = core.decide("a", 0.0).start
    eng = SimEngine(COST)
    for w in works:
        eng.submit(w)
    assert sorted(eng.held()) == sorted((w.seq_id, w.attempt) for w in works)
    eng.core.advance()
    eng.drain()
    assert eng.held() == []  # both finished (6 tokens) and reported


def test_a_give_up_in_a_lost_reply_is_sent_again_once_the_replica_still_lists_the_attempt():
    core, bid = setup(n=1, max_tokens=50)
    (work,) = core.decide("a", 0.0).start
    key = (work.seq_id, work.attempt)
    core.on_report(report([SeqProgress(work.seq_id, work.attempt, [7, 8], offset=0)], held=[key]), 0.1)
    assert core.cancel(bid, 0.15) == 1
    assert core.decide("a", 0.2).give_up == [key]  # this reply is lost
    # the next report, without the list, cannot tell: nothing is resent
    assert core.on_report(report(), 0.3).give_up == []
    again = core.on_report(report(held=[key]), 0.4).give_up  # the replica still runs it
    assert again == [key] and core.counters.lost_orders == 1
    # this time it arrives: the engine lists the attempt as aborting, then reports the abort
    assert core.on_report(report(held=[key], aborting=[key]), 0.5).give_up == []
    core.on_report(report([SeqProgress(work.seq_id, work.attempt, [9], None, "abort", offset=2)], held=[]), 0.6)
    done, _, finished = core.fetch(bid, 0)
    assert finished and done[0].finish_reason == "abort" and done[0].token_ids == [7, 8, 9]
    assert core.counters.lost_orders == 1


def test_a_delivered_give_up_is_not_sent_twice():
    core, bid = setup(n=1, max_tokens=50)
    (work,) = core.decide("a", 0.0).start
    core.cancel(bid, 0.1)
    (key,) = core.decide("a", 0.2).give_up
    assert core.on_report(report(held=[key], aborting=[key]), 0.3).give_up == []  # applied, abort on its way
    # an engine that aborts at once reports the abort with the list that no longer holds it
    core.on_report(report([SeqProgress(work.seq_id, work.attempt, [4], None, "abort", offset=0)], held=[]), 0.4)
    done, _, finished = core.fetch(bid, 0)
    assert finished and done[0].token_ids == [4]
    assert core.counters.lost_orders == 0


def test_the_sim_replica_stops_listing_what_it_gives_up():
    import asyncio

    from rollout_cluster.engines.sim_engine import SimEngine

    core, _ = setup(n=2, max_tokens=50)
    works = core.decide("a", 0.0).start
    eng = SimEngine(COST)
    for w in works:
        eng.submit(w)
    asyncio.run(eng.give_up([(works[0].seq_id, works[0].attempt)]))
    assert eng.held() == [(works[1].seq_id, works[1].attempt)]


def test_a_report_past_the_tokens_held_is_not_applied_and_the_sequence_continues_from_them():
    """Tokens 2-3 never came: the report that starts at 4 is dropped, the replica is told to give
    the attempt up, and the sequence continues from [7, 8] elsewhere; its completion has no hole."""
    core, bid = setup(n=1, max_tokens=6)
    (work,) = core.decide("a", 0.0).start
    core.on_report(report([SeqProgress(work.seq_id, work.attempt, [7, 8], offset=0)]), 0.1)
    orders = core.on_report(report([SeqProgress(work.seq_id, work.attempt, [11], offset=4)]), 0.2)
    assert core.counters.report_gaps == 1 and core.counters.generated_tokens == 2
    assert (work.seq_id, work.attempt) in orders.give_up
    # the give-up's final is a delta past the hole too: the segment ends at the tokens held
    orders = core.on_report(report([SeqProgress(work.seq_id, work.attempt, [12], None, "abort", offset=5)]), 0.3)
    (again,) = orders.start or core.decide("a", 0.35).start
    assert again.attempt == work.attempt + 1 and again.prompt_token_ids == [1, 2, 7, 8]
    assert again.sampling.max_tokens == 4
    core.on_report(report([SeqProgress(again.seq_id, again.attempt, [9, 10, 11, 12], None, "length", offset=0)]), 0.4)
    done, _, finished = core.fetch(bid, 0)
    assert finished and done[0].token_ids == [7, 8, 9, 10, 11, 12]
    assert core.counters.report_gaps == 2 and core.counters.generated_tokens == 6
    assert [m.reason for m in done[0].migrations] == ["report_gap"]


def test_a_final_past_the_tokens_held_makes_its_end_again():
    core, bid = setup(n=1, max_tokens=6)
    (work,) = core.decide("a", 0.0).start
    core.on_report(report([SeqProgress(work.seq_id, work.attempt, [7, 8], offset=0)]), 0.1)
    orders = core.on_report(report([SeqProgress(work.seq_id, work.attempt, [12], None, "length", offset=5)]), 0.2)
    (again,) = orders.start or core.decide("a", 0.25).start
    assert again.prompt_token_ids == [1, 2, 7, 8] and again.sampling.max_tokens == 4
    core.on_report(report([SeqProgress(again.seq_id, again.attempt, [9, 10, 11, 12], None, "length", offset=0)]), 0.3)
    done, _, finished = core.fetch(bid, 0)
    assert finished and done[0].token_ids == [7, 8, 9, 10, 11, 12] and core.counters.report_gaps == 1


# ---- a driver's fetch whose answer is lost ----------------------------------------------------------
def finish(core, work, at):
    core.on_report(report([SeqProgress(work.seq_id, work.attempt, [3] * 6, None, "length", offset=0)]), at)


def test_the_last_fetch_of_a_batch_lost_on_the_way_is_answered_again():
    """Regression: the router dropped a batch once a fetch answered it whole. A driver whose call
    timed out on that slow answer (call_timeout_s; the follower fetches again) got "unknown batch":
    the batch's last completions were lost, or generated again. Now the retry, from the same
    cursor, gets the same completions, none twice; the driver's fetch from the end releases it."""
    core, bid = setup(n=3)
    first, second, third = core.decide("a", 0.0).start
    follow = BatchFollower([SequenceRequest([1, 2], SamplingSpec(max_tokens=6), i, 0) for i in range(3)])
    follow.next(0.0)
    follow.submitted({"batch_id": bid, "weights_version": 0}, 0.0)
    finish(core, first, 1.0)
    assert follow.next(1.0) == Fetch(bid, 0)
    follow.take(*core.fetch(bid, 0, 1.0)[:2])
    finish(core, second, 2.0)
    finish(core, third, 2.0)
    assert follow.next(2.0) == Fetch(bid, 1)
    lost = core.fetch(bid, 1, 2.0)  # the batch's whole answer: it never reaches the driver
    assert lost[2] and len(lost[0]) == 2
    follow.fetch_failed(TimeoutError("no answer"), 122.0, router_gone=True)  # the call timed out
    assert follow.next(122.0) == Pause(0.5)
    assert follow.next(122.5) == Fetch(bid, 1)
    again, cursor, done = core.fetch(bid, 1, 122.5)
    assert done and cursor == 3 and [c.index for c in again] == [c.index for c in lost[0]]
    follow.take(again, cursor)
    assert follow.done and sorted(c.index for c in follow.results) == [0, 1, 2]
    assert follow.next(123.0) == Fetch(bid, 3, 0.0)  # "I hold them all": the router forgets the batch
    assert core.fetch(bid, 3, 123.0) == ([], 3, True) and bid not in core.batches
    follow.take([], 3)
    assert [c.index for c in follow.next(123.1).results] == [0, 1, 2]
    with pytest.raises(KeyError, match="unknown batch"):
        core.fetch(bid, 1, 124.0)


def test_a_batch_fetched_whole_and_never_acknowledged_is_dropped_after_finished_batch_keep_s():
    core, bid = setup(n=1)
    (work,) = core.decide("a", 0.0).start
    finish(core, work, 1.0)
    assert core.fetch(bid, 0, 10.0)[2]  # answered whole; the driver stops (or dies) without saying so
    assert core.fetch(bid, 0, 20.0)[2]  # a retry: the same answer, the keep time counted from the first
    assert core.drop_finished(370.0, keep_s=360.0) == [] and bid in core.batches
    assert core.drop_finished(370.5, keep_s=360.0) == [bid] and bid not in core.batches
    with pytest.raises(KeyError, match=r"fetched whole 360 s ago.*router.finished_batch_keep_s"):
        core.fetch(bid, 0, 371.0)


def test_a_batch_not_fetched_whole_is_not_dropped_as_finished():
    core, bid = setup(n=2)
    first, _ = core.decide("a", 0.0).start
    finish(core, first, 1.0)
    core.fetch(bid, 0, 1.0)
    assert core.drop_finished(1e6, keep_s=360.0) == [] and bid in core.batches


def test_finished_batch_keep_s_covers_a_retry():
    assert load_config({}).router.finished_batch_keep_s == 360.0
    with pytest.raises(ConfigError,
                       match=r"router.finished_batch_keep_s=100.0: must be >= router.call_timeout_s = 120"):
        load_config({"router": {"finished_batch_keep_s": 100}})


def test_a_failed_final_fetch_does_not_fail_a_batch_received_whole():
    follow = BatchFollower([SequenceRequest([1, 2], SamplingSpec(max_tokens=6), 0, 0)])
    follow.next(0.0)
    follow.submitted({"batch_id": "r-b0", "weights_version": 0}, 0.0)
    follow.next(0.1)
    follow.take([Completion(0, 0, [1], None, "length", index=0)], 1)
    assert follow.next(0.2) == Fetch("r-b0", 1, 0.0)
    follow.fetch_failed(KeyError("unknown batch"), 0.3)  # (a router of before the fix released it already)
    done = follow.next(0.3)
    assert isinstance(done, Done) and [c.index for c in done.results] == [0]


def test_the_serve_router_answers_a_retried_last_fetch_and_forgets_the_batch_at_the_drivers_final_fetch(
        tmp_path, monkeypatch):
    """The same at the Router deployment's class (in-process, no Ray), where the batch was
    released: its fetch answered done, then "unknown batch" to the retry of that fetch."""
    import asyncio

    from rollout_cluster.config import ClusterConfig, to_dict
    from rollout_cluster.protocol import WeightsState
    from rollout_cluster.security.signing import Signer
    from rollout_cluster.serve.router import Router

    monkeypatch.delenv("ROLLOUT_CONTROL_KEYS")  # unsigned orders (allow_unsigned_control)

    async def run():
        cfg = ClusterConfig(replicas=1, engine={"kind": "sim"}, router={"idle_pull_wait_s": 0.01},
                            security={"allow_unsigned_control": True, "checkpoint_roots": [str(tmp_path)]})
        router = Router.func_or_class(to_dict(cfg))
        try:
            cred = await router.register(Signer().sign("register", {"replica_id": "a", "incarnation": "i1"}))

            async def pull(rep):
                rep.credential = cred
                rep.weights = WeightsState(version=router.core.weights.version, path=router.core.weights.path)
                return await router.pull(rep)

            await pull(report(model=ModelInfo(100, 64)))
            bid = await router.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=4), i, 0) for i in range(2)],
                                      wait_for_replica_s=1)
            works = (await pull(report())).start
            await pull(report([SeqProgress(w.seq_id, w.attempt, [5] * 4, None, "length", offset=0) for w in works]))
            lost = await router.fetch(bid, 0, wait_s=1)  # never reaches the driver
            again = await router.fetch(bid, 0, wait_s=1)
            assert again[2] and again[1] == 2 and [c.index for c in again[0]] == [c.index for c in lost[0]] == [0, 1]
            assert await router.fetch(bid, 2, wait_s=0) == ([], 2, True)  # the driver's final fetch
            assert bid not in router.core.batches and bid not in (await router.status())["batch_ids"]
        finally:
            router._reaper.cancel()

    asyncio.run(run())
