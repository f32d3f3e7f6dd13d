"""The router's core for moving sequences at its edges (moves, dispatch, reports): two keep swaps
in one attempt are two marks, a mark past the tokens kept labels none, a continuation kept for a
replica that cannot take work goes back to all, a broken engine's hand-back counts as a death's.
(A review found each; the docstrings say what was wrong.)"""
from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import (EngineStats, LoadWeights, Listing, ModelInfo, Report, SamplingSpec,
                                      SeqProgress, SequenceRequest, WeightsState)
from rollout_cluster.policy.base import GiveUp
from rollout_cluster.policy.pull import PullPolicy
from rollout_cluster.router.core import RouterCore
from rollout_cluster.router.state import SeqStatus

COST = load_profile("h200-1.5b", max_num_seqs=8)


def make_core(replicas=("a",), policy="pull", prefix=""):
    core = RouterCore(make_policy(PolicyConfig(name=policy), COST), expected_replicas=len(replicas),
                      replica_timeout_s=5.0, id_prefix=prefix)
    for rid in replicas:
        pull(core, rid, 0.0, model=ModelInfo(100, 64))
    return core


def pull(core, rid, now, progress=(), version=0, path="", held=None, aborting=(), leaving=False,
         engine_dead=False, model=None, inc="i1"):
    return core.on_report(Report(rid, inc, progress=list(progress), stats=EngineStats(), capacity=8, model=model,
                                 weights=WeightsState(version=version, path=path), leaving=leaving,
                                 engine_dead=engine_dead,
                                 listing=None if held is None else Listing(list(held), list(aborting))), now)


def test_two_keep_swaps_under_one_attempt_are_recorded_once_each():
    """Wrong: the engine sends every swap of an attempt with every later report (vllm_seqs.py keeps
    `swaps[key]` as a growing list). After two keep swaps under one attempt (update_weights
    running="keep" to v1, then to v2), each report carries [(3, 1), (5, 2)], and
    ReportApplier.note_swaps (reports.py:146) skips a pair only when its version is the *last* one
    in weight_versions: at every report after the second swap it appends (5, 1) then (5, 2) again.
    The Completion's weight_versions then says version 1 made token 5 and grows by two entries per
    report, and counters.weights_kept grows by two per report.
    Right: weight_versions == [(0, 0), (3, 1), (5, 2)] and weights_kept == 2, however many reports
    repeat the swaps."""
    core = make_core()
    bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=12), 0, 0)], 0.0)
    (w,) = pull(core, "a", 0.1).start
    pull(core, "a", 0.2, [SeqProgress(w.seq_id, w.attempt, [7, 7, 7], offset=0)])
    core.update_weights("/ckpt/1", running="keep", now=0.3)
    assert [c for c in pull(core, "a", 0.4).control if isinstance(c, LoadWeights)] == [
        LoadWeights("/ckpt/1", 1, keep=True)]
    pull(core, "a", 0.5, [SeqProgress(w.seq_id, w.attempt, [8, 8], offset=3, swaps=[(3, 1)])], 1, "/ckpt/1")
    core.update_weights("/ckpt/2", running="keep", now=0.6)
    assert [c for c in pull(core, "a", 0.7, version=1, path="/ckpt/1").control if isinstance(c, LoadWeights)] == [
        LoadWeights("/ckpt/2", 2, keep=True)]
    swaps = [(3, 1), (5, 2)]
    pull(core, "a", 0.8, [SeqProgress(w.seq_id, w.attempt, [9, 9], offset=5, swaps=swaps)], 2, "/ckpt/2")
    pull(core, "a", 0.9, [SeqProgress(w.seq_id, w.attempt, [6], offset=7, swaps=swaps)], 2, "/ckpt/2")
    pull(core, "a", 1.0, [SeqProgress(w.seq_id, w.attempt, [5] * 4, None, "length", offset=8, swaps=swaps)],
         2, "/ckpt/2")
    (c,), _, finished = core.fetch(bid, 0, 1.1)
    assert finished and len(c.token_ids) == 12
    assert c.weight_versions == [(0, 0), (3, 1), (5, 2)], c.weight_versions
    assert core.counters.weights_kept == 2


class ArmedPolicy(PullPolicy):
    """pull's dispatch, plus the give-ups a test arms (seq_id -> destination), at the next decision."""

    name = "armed"

    def __init__(self):
        self.armed: dict = {}

    def decide(self, view, replica_id):
        d = super().decide(view, replica_id)
        for sid, dest in list(self.armed.items()):
            seq = view.seqs.get(sid)
            if seq is not None and seq.status is SeqStatus.RUNNING and seq.replica in view.replicas:
                d.give_up.append(GiveUp(seq, dest))
                del self.armed[sid]
        return d


def armed_core(replicas=("a", "b")):
    policy = ArmedPolicy()
    core = RouterCore(policy, expected_replicas=len(replicas), replica_timeout_s=5.0)
    for rid in replicas:
        pull(core, rid, 0.0, model=ModelInfo(100, 64))
    return core, policy


def test_a_continuation_reserved_for_a_replica_that_cannot_load_the_weights_runs_elsewhere():
    """Wrong: a policy's give-up reserves the continuation for its destination (moves.py:150-153:
    `reserved_for=destination` whenever the destination is still in the fleet), and only
    Membership.remove releases a reserved lane (state.WorkQueue.release_reserved). A destination
    that stays in the fleet but can never take work (its load of the current weights failed: it
    keeps pulling and is hidden from the policy, Dispatcher.decide skips it) keeps the continuation
    for ever: every other replica pulls, the pull policy takes only its own reserved lane, and the
    sequence never comes back (the batch hangs until its driver cancels it).
    Right: a continuation reserved for a replica that cannot get work (not usable, its load failed)
    goes back to every replica, as it does when that replica dies."""
    core, policy = armed_core()
    bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=10), i, 0) for i in range(2)], 0.0)
    (wa,) = pull(core, "a", 0.1).start
    (wb,) = pull(core, "b", 0.1).start
    pull(core, "a", 0.2, [SeqProgress(wa.seq_id, wa.attempt, [7, 7], offset=0)])
    policy.armed[wa.seq_id] = "b"
    assert pull(core, "a", 0.3).give_up == [(wa.seq_id, wa.attempt)]  # delivered: a's engine aborts it
    core.update_weights("/ckpt/1", running="keep", now=0.4)  # an in-flight update while the move is on its way
    assert any(isinstance(c, LoadWeights) for c in pull(core, "b", 0.5).control)
    # b's load fails: b keeps pulling on the old weights, and can get no work
    core.on_report(Report("b", "i1", stats=EngineStats(), capacity=8,
                          weights=WeightsState(version=0, error="boom", error_version=1, error_path="/ckpt/1")), 0.6)
    assert "b" in core.weights.errors
    assert any(isinstance(c, LoadWeights) for c in pull(core, "a", 0.7).control)
    # a's abort final comes back (the move's partials), then a holds the new weights
    pull(core, "a", 0.8, [SeqProgress(wa.seq_id, wa.attempt, [8], None, "abort", offset=2)], 1, "/ckpt/1")
    # b ends its own sequence (on the weights it kept) and from then on holds nothing: never stalled
    failed = WeightsState(version=0, error="boom", error_version=1, error_path="/ckpt/1")
    core.on_report(Report("b", "i1", stats=EngineStats(), capacity=8, weights=failed, progress=[
        SeqProgress(wb.seq_id, wb.attempt, [5] * 10, None, "length", offset=0)]), 0.9)
    started = []
    for i in range(20):
        started += pull(core, "a", 1.0 + i, version=1, path="/ckpt/1").start
        core.on_report(Report("b", "i1", stats=EngineStats(), capacity=8, weights=failed), 1.0 + i)
        core.expire(1.0 + i)
    assert [w.seq_id for w in started] == [wa.seq_id], (
        f"the continuation waits in b's reserved lane: { {r: list(l) for r, l in core.queue.reserved.items()} }")


def test_a_dead_engines_goodbye_with_aborted_partials_counts_them_as_recovered_not_handed_back():
    """Wrong: a replica whose engine broke (serve/pull_loop.py leave_broken_engine: a keep swap or a
    push that left the weights a mix) gives up what it holds and says goodbye marked `engine_dead`,
    its partials ending "abort". RouterCore.apply applies the progress before the removal, and
    ReportApplier.seq_progress (reports.py:113) labels every unordered "abort" as a hand-back:
    Migration reason "replica_left", counter `handed_back`, although the same report is then
    counted as a replica death (Membership.remove with leaving=False), not a scale-down.
    Right (docs/semantics.md, "The engine dies under the replica"): the sequences of a replica whose
    engine died continue with reason "replica_lost" and count in `recovered`; `handed_back` is for
    a replica Serve stopped on purpose."""
    core = make_core(("a", "b"))
    bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=10), 0, 0)], 0.0)
    (w,) = pull(core, "a", 0.1).start
    pull(core, "a", 0.2, [SeqProgress(w.seq_id, w.attempt, [7, 7], offset=0)])
    pull(core, "a", 0.3, [SeqProgress(w.seq_id, w.attempt, [8], None, "abort", offset=2)],
         leaving=True, engine_dead=True)
    assert core.counters.replica_deaths == 1 and core.counters.replica_leaves == 0
    (again,) = pull(core, "b", 0.4).start
    pull(core, "b", 0.5, [SeqProgress(again.seq_id, again.attempt, [9] * 7, None, "length", offset=0)])
    (c,), _, finished = core.fetch(bid, 0, 0.6)
    assert finished and list(c.token_ids) == [7, 7, 8] + [9] * 7
    assert [m.reason for m in c.migrations] == ["replica_lost"], c.migrations
    assert core.counters.recovered == 1 and core.counters.handed_back == 0


def test_a_swap_mark_past_the_tokens_kept_does_not_label_a_sequence_that_ends_there():
    """Wrong: vLLM marks a keep swap at the tokens its worker sampled, which may be past the tokens
    the replica delivered (stream_interval holds them back; test_weights_in_flight.py's regression).
    SeqMoves.dispatch (moves.py:56-57) drops such a mark when the sequence continues elsewhere, but
    a sequence that ends there (cancelled, or cut at finish_fraction: its abort final brings no
    token past those delivered) keeps it: SeqMoves.finish (moves.py:168-169) reports
    weight_versions [(0, 0), (6, 1)] for 4 tokens and weights_version 1, though version 1 made none
    of its tokens (a trainer that keeps the samples of the new policy takes this one).
    Right: a mark at or past the tokens kept labels none of them: weight_versions [(0, 0)] and
    weights_version 0, as after a continuation elsewhere."""
    core = make_core()
    bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=20), 0, 0)], 0.0)
    (w,) = pull(core, "a", 0.1).start
    pull(core, "a", 0.2, [SeqProgress(w.seq_id, w.attempt, [7, 7, 7], offset=0)])
    core.update_weights("/ckpt/1", running="keep", now=0.3)
    pull(core, "a", 0.4)  # the keep load
    # the worker swapped at its 6th token; the replica has delivered 4
    pull(core, "a", 0.5, [SeqProgress(w.seq_id, w.attempt, [8], offset=3, swaps=[(6, 1)])], 1, "/ckpt/1")
    core.cancel(bid, 0.6)  # the driver cuts the batch (timeout, finish_fraction)
    assert pull(core, "a", 0.7, version=1, path="/ckpt/1").give_up == [(w.seq_id, w.attempt)]
    pull(core, "a", 0.8, [SeqProgress(w.seq_id, w.attempt, [], None, "abort", offset=4, swaps=[(6, 1)])],
         1, "/ckpt/1")
    (c,), _, finished = core.fetch(bid, 0, 0.9)
    assert finished and c.finish_reason == "abort" and list(c.token_ids) == [7, 7, 7, 8]
    assert c.weight_versions == [(0, 0)], c.weight_versions
    assert c.weights_version == 0
