"""A late pull of a replica's old incarnation (processed after the restarted replica's
first pull) does not take the live incarnation's work away. docs/semantics.md: "A replica that
restarts comes back with a new incarnation id; the router drops the old incarnation's work ...
A report from a replica already declared dead is stale and dropped." """
from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import EngineStats, ModelInfo, Report, SamplingSpec, SeqProgress, SequenceRequest
from rollout_cluster.router.core import RouterCore

COST = load_profile("a100-80g-7b")


def report(inc: str, progress=(), number: int = 0) -> Report:
    return Report("a", inc, progress=list(progress), stats=EngineStats(), model=ModelInfo(100, 64), capacity=8,
                  number=number)


def test_a_late_report_of_the_old_incarnation_does_not_evict_the_new_one():
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=1, replica_timeout_s=60.0)
    core.on_report(report("old", number=1), 0.0)
    core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=20), 0, 0)], 0.0)
    (w1,) = core.decide("a", 0.1).start
    late = report("old", [SeqProgress(w1.seq_id, w1.attempt, [5, 6], offset=0)], number=2)  # sent at 0.5, stuck
    # the replica restarts under the same id: its old work is requeued, the new incarnation takes it
    orders = core.on_report(report("new", number=1), 1.0)
    (w2,) = orders.start
    core.on_report(report("new", [SeqProgress(w2.seq_id, w2.attempt, [7, 8, 9], offset=0)], number=2), 1.2)
    seq = core.seqs[w2.seq_id]
    assert (seq.replica, seq.attempt, seq.generated) == ("a", w2.attempt, 3)
    deaths = core.counters.replica_deaths
    core.on_report(late, 1.5)  # the old incarnation's pull, processed late
    assert core.fleet.replicas["a"].incarnation == "new"
    assert core.counters.replica_deaths == deaths
    assert seq.attempt == w2.attempt and seq.replica == "a"  # the live incarnation keeps its work
