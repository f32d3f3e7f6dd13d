"""A replica that shuts down gracefully (Serve scales the deployment down or replaces the replica)
gives up what it holds and says goodbye: its sequences continue elsewhere at once, from every
token it produced, instead of after router.replica_timeout_s from the last report."""
from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.router.core import RouterCore
from rollout_cluster.protocol import EngineStats, ModelInfo, Report, SamplingSpec, SeqProgress, SequenceRequest

COST = load_profile("h200-1.5b", max_num_seqs=8)


def report(rid, progress=(), model=None, leaving=False):
    return Report(rid, f"{rid}-1", progress=list(progress), stats=EngineStats(), model=model, capacity=8,
                  leaving=leaving)


def test_a_leaving_replica_hands_its_partials_back_and_gets_nothing_more():
    from rollout_cluster.serve.metrics import PrometheusRouterMetrics

    metrics = PrometheusRouterMetrics(port=0)
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=2, replica_timeout_s=60.0,
                      metrics=metrics)
    core.on_report(report("a", model=ModelInfo(100, 64)), 0.0)
    bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=6), i, 0) for i in range(2)], 0.0)
    works = core.decide("a", 0.0).start
    assert len(works) == 2
    metrics.gauges(core)
    assert metrics.registry.get_sample_value("rollout_sequences_running", {"replica": "a"}) == 2
    first, second = works
    core.on_report(report("a", [SeqProgress(first.seq_id, first.attempt, [7], offset=0)]), 0.1)
    # shutting down: it gave both up; the final report has every token since the last one
    final = [SeqProgress(first.seq_id, first.attempt, [8, 9], None, "abort", offset=1),
             SeqProgress(second.seq_id, second.attempt, [5], None, "abort", offset=0)]
    orders = core.on_report(report("a", final, leaving=True), 0.2)
    assert not orders.start and "a" not in core.fleet.replicas
    assert core.counters.replica_leaves == 1 and core.counters.replica_deaths == 0
    assert core.counters.migrations == 0  # a hand-back is not a policy's move
    # another replica takes both at once, each with its partial output as part of the prompt
    again = {w.seq_id: w for w in core.on_report(report("b"), 0.3).start}  # b's first pull
    assert again[first.seq_id].prompt_token_ids == [1, 2, 7, 8, 9] and again[first.seq_id].sampling.max_tokens == 3
    assert again[second.seq_id].prompt_token_ids == [1, 2, 5] and again[second.seq_id].sampling.max_tokens == 5
    core.on_report(report("b", [SeqProgress(first.seq_id, again[first.seq_id].attempt, [1, 1, 1], None, "length"),
                                SeqProgress(second.seq_id, again[second.seq_id].attempt, [2] * 5, None, "length")]), 0.4)
    done, _, finished = core.fetch(bid, 0)
    assert finished and sorted(c.token_ids for c in done) == [[5, 2, 2, 2, 2, 2], [7, 8, 9, 1, 1, 1]]
    assert {tuple(c.replicas) for c in done} == {("a", "b")}
    # each records where and why it left "a": handed back, at the token it had reached
    assert sorted((m.source, m.destination, m.at_token, m.reason) for c in done for m in c.migrations) == [
        ("a", "b", 1, "replica_left"), ("a", "b", 3, "replica_left")]
    assert core.counters.handed_back == 2 and core.counters.recovered == 0
    sample = metrics.registry.get_sample_value
    assert sample("rollout_sequences_resumed_total", {"source": "a", "reason": "replica_left"}) == 2
    assert sample("rollout_migrations_total", {"source": "a"}) is None  # not the policy's moves
    metrics.gauges(core)
    assert sample("rollout_replicas_expected") == core.fleet.expected == 1
    # the replica that left is no longer a series (a sum over replicas would count it forever)
    assert sample("rollout_sequences_running", {"replica": "a"}) is None
    assert sample("rollout_sequences_running", {"replica": "b"}) == 0


def test_work_a_leaving_replica_did_not_report_is_requeued_from_its_last_tokens():
    """A final report that misses a sequence (its abort did not finish in time) loses nothing
    already reported: the sequence is requeued as for a dead replica, but at once."""
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=1, replica_timeout_s=60.0)
    core.on_report(report("a", model=ModelInfo(100, 64)), 0.0)
    bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=4), 0, 0)], 0.0)
    (work,) = core.decide("a", 0.0).start
    core.on_report(report("a", [SeqProgress(work.seq_id, work.attempt, [7, 8], offset=0)]), 0.1)
    core.on_report(report("a", leaving=True), 0.2)
    assert len(core.queue) == 1 and core.counters.replica_leaves == 1
    (again,) = core.on_report(report("b"), 0.3).start
    assert again.prompt_token_ids == [1, 2, 7, 8]
    core.on_report(report("b", [SeqProgress(work.seq_id, again.attempt, [3, 4], None, "length")]), 0.4)
    (done,) = core.fetch(bid, 0)[0]
    assert done.token_ids == [7, 8, 3, 4]
    assert [(m.source, m.destination, m.at_token, m.reason) for m in done.migrations] == [("a", "b", 2, "replica_lost")]
    assert core.counters.handed_back == 0 and core.counters.recovered == 1


def test_a_give_up_the_leaving_replica_never_received_is_not_counted_as_the_policys_move():
    """The policy ordered a give-up, but the replica left before it pulled the order: the move
    is the hand-back's, not the policy's (no migration counted, no re-prefill charged to it)."""
    from rollout_cluster.policy.base import Decision, GiveUp

    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=2, replica_timeout_s=60.0)
    core.on_report(report("a", model=ModelInfo(100, 64)), 0.0)
    core.on_report(report("b"), 0.0)
    bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=6), 0, 0)], 0.0)
    (work,) = core.decide("a", 0.1).start
    core.on_report(report("a", [SeqProgress(work.seq_id, work.attempt, [7], offset=0)]), 0.2)
    core.dispatcher.apply_decision(Decision(give_up=[GiveUp(core.seqs[work.seq_id], destination="b")]), 0.3)  # in a's outbox
    core.on_report(report("a", [SeqProgress(work.seq_id, work.attempt, [8], None, "abort", offset=1)], leaving=True), 0.4)
    assert core.counters.migrations == 0 and core.counters.handed_back == 1
    assert core.counters.reprefill_tokens == 0
    (again,) = core.on_report(report("b"), 0.5).start
    core.on_report(report("b", [SeqProgress(work.seq_id, again.attempt, [1] * 4, None, "length")]), 0.6)
    (done,) = core.fetch(bid, 0)[0]
    assert [(m.source, m.destination, m.at_token, m.reason) for m in done.migrations] == [("a", "b", 2, "replica_left")]


def test_a_later_segment_cut_does_not_rewrite_where_a_hand_back_went():
    """chunked cuts segments: after a hand-back from a to b, b's segment ends at the chunk cap (not a
    move) and the rest runs on c. The hand-back's record still says a -> b."""
    core = RouterCore(make_policy(PolicyConfig(name="chunked", chunk_tokens=2), COST), expected_replicas=1,
                      replica_timeout_s=60.0)
    core.on_report(report("a", model=ModelInfo(100, 64)), 0.0)
    bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=6), 0, 0)], 0.0)
    (work,) = core.decide("a", 0.1).start
    core.on_report(report("a", [SeqProgress(work.seq_id, work.attempt, [7], offset=0)]), 0.2)
    core.on_report(report("a", [SeqProgress(work.seq_id, work.attempt, [], None, "abort", offset=1)], leaving=True), 0.3)
    (on_b,) = core.on_report(report("b"), 0.4).start
    # b's segment ends at the chunk cap, in b's last report (it is being scaled down): c runs the rest
    core.on_report(report("b", [SeqProgress(work.seq_id, on_b.attempt, [8, 9], None, "length")], leaving=True), 0.5)
    (on_c,) = core.on_report(report("c"), 0.6).start
    core.on_report(report("c", [SeqProgress(work.seq_id, on_c.attempt, [1, 2, 3], None, "length")]), 0.7)
    (done,) = core.fetch(bid, 0)[0]
    assert done.token_ids == [7, 8, 9, 1, 2, 3] and done.replicas == ["a", "b", "c"]
    assert [(m.source, m.destination, m.at_token, m.reason) for m in done.migrations] == [("a", "b", 1, "replica_left")]
