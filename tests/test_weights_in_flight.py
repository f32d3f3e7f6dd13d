"""Weights updated while sequences run (update_weights / push_weights running=...): "recompute"
continues every running sequence on the new weights from its tokens so far, "abort" ends them as
partial rollouts, "finish" refuses while any is unfinished; queued work runs on the new weights;
each Completion's weight_versions says which version made which tokens; nothing lost or doubled."""
import pytest

from rollout_cluster.protocol import (EngineStats, InputError, LoadWeights, ModelInfo, Report, SamplingSpec,
                                      SeqProgress, SequenceRequest, WeightsState)

from test_fleet_sleep import core_with


def report(core, rid, now, progress=(), version=0, path=""):
    return core.on_report(Report(rid, "i1", progress=list(progress), stats=EngineStats(), capacity=8,
                                 weights=WeightsState(version=version, path=path)), now)


def started(core):
    """A batch of 4 (max_tokens 10) on replicas a and b, each sequence 3 tokens in."""
    bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=10), i, 0) for i in range(4)], 0.0)
    works = {}
    for rid in ("a", "b"):
        works[rid] = report(core, rid, 0.1).start
        report(core, rid, 0.2, [SeqProgress(w.seq_id, w.attempt, [7, 7, 7], None, None) for w in works[rid]])
    assert sum(len(w) for w in works.values()) == 4
    return bid, works


def test_recompute_continues_the_running_sequences_on_the_new_weights_from_their_tokens():
    core = core_with(("a", "b"))
    bid, works = started(core)
    queued = core.submit([SequenceRequest([3], SamplingSpec(max_tokens=2), 0, 0)], 0.3)  # never started
    assert core.update_weights("/ckpt/1", running="recompute") == 1
    continuations = []
    for rid in ("a", "b"):
        orders = report(core, rid, 1.0)
        assert [c for c in orders.control if isinstance(c, LoadWeights)] == [LoadWeights("/ckpt/1", 1)]
        assert sorted(orders.give_up) == sorted((w.seq_id, w.attempt) for w in works[rid])
        assert orders.start == []  # nothing starts on the old weights
        # the engine aborts them before it loads: one more old-weights token made it
        report(core, rid, 1.1, [SeqProgress(w.seq_id, w.attempt, [8], None, "abort") for w in works[rid]])
        continuations += report(core, rid, 1.2, version=1, path="/ckpt/1").start
    seqs = {w.seq_id for rid in works for w in works[rid]}
    assert {w.seq_id for w in continuations} >= seqs
    for w in continuations:
        if w.seq_id in seqs:
            assert w.prompt_token_ids == [1, 2, 7, 7, 7, 8] and w.sampling.max_tokens == 6
    for rid in ("a", "b"):
        report(core, rid, 2.0, [SeqProgress(w.seq_id, w.attempt, [9] * w.sampling.max_tokens, None, "length")
                                for w in continuations], version=1, path="/ckpt/1")
    done, _, finished = core.fetch(bid, 0, 2.0)
    assert finished and len(done) == 4
    for c in done:
        assert list(c.token_ids) == [7, 7, 7, 8] + [9] * 6 and c.finish_reason == "length"
        assert c.weight_versions == [(0, 0), (4, 1)] and c.weights_version == 1
        assert c.to_json()["weight_versions"] == [[0, 0], [4, 1]]
    (q,), _, _ = core.fetch(queued, 0, 2.0)
    assert q.weight_versions == [(0, 1)] and len(q.token_ids) == 2  # queued work ran on the new weights only
    assert core.counters.weights_recomputed == 4 and core.counters.migrations == 0


def test_abort_hands_the_running_sequences_back_as_partial_rollouts():
    core = core_with(("a", "b"))
    bid, works = started(core)
    core.update_weights("/ckpt/1", running="abort")
    for rid in ("a", "b"):
        orders = report(core, rid, 1.0)
        report(core, rid, 1.1, [SeqProgress(w.seq_id, w.attempt, [], None, "abort") for w in works[rid]])
    done, _, finished = core.fetch(bid, 0, 1.2)
    assert finished and [list(c.token_ids) for c in done] == [[7, 7, 7]] * 4
    assert all(c.finish_reason == "abort" and c.weight_versions == [(0, 0)] for c in done)
    assert not core.seqs and not core.queue


def test_finish_refuses_while_a_sequence_runs_and_unknown_modes_are_named():
    core = core_with(("a", "b"))
    started(core)
    with pytest.raises(RuntimeError, match="unfinished"):
        core.update_weights("/ckpt/1")
    with pytest.raises(InputError, match="running='later'"):
        core.update_weights("/ckpt/1", running="later")
    assert core.weights.version == 0


def test_a_sequence_that_ends_before_the_give_up_lands_keeps_its_old_version():
    core = core_with(("a", "b"))
    bid, works = started(core)
    core.update_weights("/ckpt/1", running="recompute")
    for rid in ("a", "b"):
        report(core, rid, 1.0)
        # the engine finished them on its own before the abort reached it: natural finals stand
        report(core, rid, 1.1, [SeqProgress(w.seq_id, w.attempt, [5] * 7, None, "length") for w in works[rid]])
    done, _, finished = core.fetch(bid, 0, 1.2)
    assert finished and all(len(c.token_ids) == 10 and c.weight_versions == [(0, 0)] for c in done)
    assert core.counters.weights_recomputed == 0


def test_keep_swaps_under_the_running_sequences_and_records_the_token_of_each_swap():
    core = core_with(("a", "b"))
    bid, works = started(core)
    queued = core.submit([SequenceRequest([3], SamplingSpec(max_tokens=2), 0, 0)], 0.3)  # never started
    assert core.update_weights("/ckpt/1", running="keep") == 1
    for rid in ("a", "b"):
        orders = report(core, rid, 1.0)
        assert [c for c in orders.control if isinstance(c, LoadWeights)] == [LoadWeights("/ckpt/1", 1, keep=True)]
        assert orders.give_up == [] and orders.start == []  # nothing given up, nothing new on the old weights
    # a made one more token on the old weights before its engine swapped; b swapped at once
    swap_at = {"a": 4, "b": 3}
    report(core, "a", 1.1, [SeqProgress(w.seq_id, w.attempt, [8], None, None, offset=3) for w in works["a"]])
    new_work = []
    for rid in ("a", "b"):
        at = swap_at[rid]
        progress = [SeqProgress(w.seq_id, w.attempt, [9, 9], None, None, offset=at, swaps=[(at, 1)])
                    for w in works[rid]]
        new_work += report(core, rid, 1.2, progress, version=1, path="/ckpt/1").start
        report(core, rid, 1.25, progress, version=1, path="/ckpt/1")  # sent again (a lost reply): no change
    for rid in ("a", "b"):
        at = swap_at[rid] + 2
        report(core, rid, 2.0, [SeqProgress(w.seq_id, w.attempt, [5] * (10 - at), None, "length", offset=at,
                                            swaps=[(swap_at[rid], 1)]) for w in works[rid]], version=1, path="/ckpt/1")
        report(core, rid, 2.1, [SeqProgress(w.seq_id, w.attempt, [6] * w.sampling.max_tokens, None, "length")
                                for w in new_work], version=1, path="/ckpt/1")
    done, _, finished = core.fetch(bid, 0, 2.0)
    assert finished and len(done) == 4
    for c in done:
        (rid,) = c.replicas
        assert len(c.token_ids) == 10 and c.finish_reason == "length"
        assert c.weight_versions == [(0, 0), (swap_at[rid], 1)] and c.weights_version == 1
    (q,), _, _ = core.fetch(queued, 0, 2.2)
    assert q.weight_versions == [(0, 1)]  # queued work ran on the new weights only
    assert core.counters.weights_kept == 4 and core.counters.weights_recomputed == 0
    assert core.counters.migrations == 0 and not core.seqs and not core.queue


# Regression: a keep swap reported past the tokens the router holds (vLLM counts the tokens its
# worker sampled; the replica had received fewer, stream_interval holds them back) stayed in
# weight_versions when the segment ended there (its replica died): the tokens between, made again
# on the new weights elsewhere, were labelled with the old version.
def test_a_swap_mark_past_the_tokens_kept_does_not_label_the_continuation_made_elsewhere():
    core = core_with(("a", "b"))
    bid, works = started(core)
    core.update_weights("/ckpt/1", running="keep")
    report(core, "a", 1.0)  # a takes its keep load
    # a swapped at its 6th token but had sent only its 4th: the mark comes before tokens 5 and 6
    report(core, "a", 1.1, [SeqProgress(w.seq_id, w.attempt, [8], None, None, offset=3, swaps=[(6, 1)])
                            for w in works["a"]], version=1, path="/ckpt/1")
    core.remove_replica("a", 1.2)  # died: its sequences continue from their 4 tokens
    report(core, "b", 1.3)  # b takes its keep load
    cont = report(core, "b", 1.4, version=1, path="/ckpt/1").start
    assert {w.seq_id for w in cont} == {w.seq_id for w in works["a"]}
    assert all(w.prompt_token_ids == [1, 2, 7, 7, 7, 8] for w in cont)
    ends = [SeqProgress(w.seq_id, w.attempt, [6] * 6, None, "length") for w in cont]
    ends += [SeqProgress(w.seq_id, w.attempt, [5] * 7, None, "length", offset=3, swaps=[(3, 1)])
             for w in works["b"]]  # b's own, swapped at once
    report(core, "b", 2.0, ends, version=1, path="/ckpt/1")
    done, _, finished = core.fetch(bid, 0, 2.1)
    assert finished and len(done) == 4 and all(len(c.token_ids) == 10 for c in done)
    for c in done:
        if c.replicas == ["a", "b"]:  # tokens 0-3 on a (version 0), 4-9 made by b on version 1
            assert c.weight_versions == [(0, 0), (4, 1)], c.weight_versions
        else:
            assert c.weight_versions == [(0, 0), (3, 1)], c.weight_versions


# Regression: Work a push policy had left in a replica's outbox (assigned at another replica's
# pull) when the weights changed with "recompute" or "abort" went out with that replica's load and
# its give-up. The replica loads first and starts work after (EngineMoves.ready_for_work), so the
# work ran on the new weights until the give-up landed: its tokens (vLLM makes one before the abort
# finds the request) came back labelled with the old version, and with "abort" it ended as a
# partial rollout of the old weights that the new ones had made.
@pytest.mark.parametrize("mode", ["recompute", "abort"])
def test_work_not_yet_sent_when_the_weights_change_in_flight_runs_on_the_new_weights_only(mode):
    from test_weights import core_with as weights_core

    core = weights_core(("a", "b"), policy="least-loaded")
    bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=4), i, 0) for i in range(4)], 0.0)
    on_a = report(core, "a", 0.1).start
    assert on_a and core.outbox.get("b") and core.outbox.get("b").start  # b's share waits for b's pull
    core.update_weights("/ckpt/1", running=mode)
    pending = {"a": [], "b": []}  # work each replica started on version 1
    for rid, at in (("a", 0.2), ("b", 0.3)):
        orders = report(core, rid, at)
        given_up = set(orders.give_up)
        # the replica loads, then starts its new work (on the new weights), then gives up: vLLM made
        # one token of such work before the abort found it; what it ran before ends with none
        ends = [SeqProgress(w.seq_id, w.attempt, [9], None, "abort") for w in orders.start
                if (w.seq_id, w.attempt) in given_up]
        pending[rid] += [w for w in orders.start if (w.seq_id, w.attempt) not in given_up]
        ends += [SeqProgress(sid, att, [], None, "abort") for sid, att in orders.give_up
                 if not any(w.seq_id == sid for w in orders.start)]
        pending[rid] += report(core, rid, at + 0.01, ends, version=1, path="/ckpt/1").start
    for t in (1.0, 1.1, 1.2):
        for rid in ("a", "b"):
            ends = [SeqProgress(w.seq_id, w.attempt, [6] * w.sampling.max_tokens, None, "length")
                    for w in pending[rid]]
            pending[rid] = report(core, rid, t, ends, version=1, path="/ckpt/1").start
    done, _, finished = core.fetch(bid, 0, 2.0)
    assert finished and len(done) == 4
    for c in done:
        # every token made after the update is labelled version 1; none was made before it
        assert c.weight_versions in ([(0, 1)], [(0, 0)]), (c.replicas, list(c.token_ids), c.weight_versions)
        if c.weight_versions == [(0, 0)]:  # "abort": a sequence that ran on a before the update ends empty
            assert mode == "abort" and c.finish_reason == "abort" and list(c.token_ids) == [] and c.replicas == ["a"]
        else:
            assert c.finish_reason == "length" and list(c.token_ids) == [6] * 4
    assert sum(c.weight_versions == [(0, 1)] for c in done) == (4 if mode == "recompute" else 4 - len(on_a))
    assert not core.seqs and not core.queue
