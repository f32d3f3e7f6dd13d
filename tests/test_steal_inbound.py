"""Steal orders no more sequences to a thief than it has free slots, and holds no re-prefill
against its budget for a give-up that is no longer on its way.

The architecture says a continuation's destination is chosen when its give-up is ordered, and
"it has counted that slot" (docs/architecture.md, "Continuations reserved for a destination").
Between the give-up order and the victim's final report the moved sequences are neither in the
thief's `seqs` nor in its reserved lane, so the policy keeps them (StealPolicy.inbound):
before, a second steal attempt by the same thief (0.5 s later, STEAL_INTERVAL_S) saw the same
free slots and ordered more, and all of them landed in the thief's reserved lane, which take_for
hands out "whatever the limit says": the thief was given 24 sequences for 8 slots."""
from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import EngineStats, ModelInfo, Report, SamplingSpec, SeqProgress, SequenceRequest
from rollout_cluster.router.core import RouterCore
from rollout_cluster.router.state import SeqStatus

COST = load_profile("h200-1.5b", max_num_seqs=64)
MODEL = ModelInfo(1000, 1 << 20)


def _pull(core, rid, cap, now, progress=(), model=None):
    return core.on_report(Report(rid, "i1", progress=list(progress), stats=EngineStats(), model=model, capacity=cap),
                          now)


def _steal_scenario():
    """Victim "a" runs 64 long sequences; thief "b" (8 slots, empty) pulls three times before
    "a" pulls again to take the give-ups (a report interval; more at fleet scale)."""
    core = RouterCore(make_policy(PolicyConfig(name="steal"), COST), expected_replicas=1, replica_timeout_s=100.0,
                      record_tokens=False)
    _pull(core, "a", 64, 0.0, model=MODEL)
    # An earlier RL step: enough tokens generated that the re-prefill budget (10 %) is not what binds.
    warm = core.submit([SequenceRequest(None, SamplingSpec(max_tokens=64000, ignore_eos=True), i, 0, prompt_len=100)
                        for i in range(64)], 0.0, batch_id="warm")
    works = _pull(core, "a", 64, 0.1).start
    _pull(core, "a", 64, 1.0, [SeqProgress(w.seq_id, w.attempt, [], None, "stop", num_tokens=30000) for w in works])
    assert core.fetch(warm, 0)[2]
    core.release(warm)
    # This step: victim "a" runs 64 long sequences; thief "b" (8 slots) joins empty.
    core.submit([SequenceRequest(None, SamplingSpec(max_tokens=64000, ignore_eos=True), i, 0, prompt_len=2000)
                 for i in range(64)], 10.0, batch_id="step")
    works = _pull(core, "a", 64, 10.0).start
    assert len(works) == 64
    _pull(core, "b", 8, 10.05, model=MODEL)
    _pull(core, "a", 64, 12.1, [SeqProgress(w.seq_id, w.attempt, [], num_tokens=6000) for w in works])
    # "b" pulls again before "a" pulls to take the give-ups (they wait in its outbox).
    _pull(core, "b", 8, 12.2)
    _pull(core, "b", 8, 12.8)
    return core


def test_steal_does_not_book_a_thief_past_its_free_slots_while_give_ups_are_in_flight():
    core = _steal_scenario()
    to_b = [sid for sid, (_, dest) in core.moves.give_up_t.items() if dest == "b"]
    assert len(to_b) <= 8, f"{len(to_b)} sequences ordered to move to a replica with 8 free slots"


def test_steal_thief_ends_up_within_its_capacity():
    core = _steal_scenario()
    # ...and once "a" hands them over, "b" is started on every one of them.
    _pull(core, "a", 64, 12.9)
    giving_up = [s for s in core.fleet.replicas["a"].seqs.values() if s.status is SeqStatus.GIVING_UP]
    _pull(core, "a", 64, 13.0, [SeqProgress(s.seq_id, s.attempt, [], None, "abort", num_tokens=0) for s in giving_up])
    started = _pull(core, "b", 8, 13.1).start
    rep = core.fleet.replicas["b"]
    assert rep.load <= rep.capacity, f"b runs {rep.load} sequences with capacity {rep.capacity} ({len(started)} started)"


def test_steal_forgets_the_reprefill_of_give_ups_that_raced_a_natural_finish():
    """A give-up that races a natural finish (docs/semantics.md) is never counted as a migration
    by the router: its re-prefill must stop counting against the budget once the sequence ended
    (before, a counter that decayed only as the router counted kept it for good)."""
    core = _steal_scenario()
    assert core.policy.inbound.get("b")
    _pull(core, "a", 64, 12.9)
    giving_up = [s for s in core.fleet.replicas["a"].seqs.values() if s.status is SeqStatus.GIVING_UP]
    # every one of them finished on its own before the abort reached the engine
    _pull(core, "a", 64, 13.0, [SeqProgress(s.seq_id, s.attempt, [], None, "stop", num_tokens=1) for s in giving_up])
    assert not core.moves.give_up_t and core.counters.migrations == 0  # nothing is in flight, nothing moved
    _pull(core, "b", 8, 13.5)  # (and may order new moves)
    held = core.policy.inbound.get("b", {})
    assert set(held) <= set(core.moves.give_up_t), held
    in_flight = sum(core.seqs[sid].context_tokens for sid in core.moves.give_up_t)
    assert sum(held.values()) <= in_flight
