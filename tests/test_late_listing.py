"""A report processed late (its call timed out at the replica, which pulled again) does not have
its stale listing taken for news. Its listing was taken before the replica got the Work of a later
reply; applied after that reply, it made the router think that Work was lost, requeue the
sequence, and run it twice (docs/architecture.md: "Reports are numbered (Report.number), so
the state a late one carries ... does not overwrite a newer one's")."""
from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import (EngineStats, Listing, ModelInfo, Report, SamplingSpec, SeqProgress,
                                      SequenceRequest)
from rollout_cluster.router.core import RouterCore
from rollout_cluster.router.state import SeqStatus

COST = load_profile("a100-80g-7b")


def report(number: int, progress=(), held=None) -> Report:
    return Report("a", "i1", progress=list(progress), stats=EngineStats(), model=ModelInfo(100, 64), capacity=8,
                  number=number, listing=None if held is None else Listing(held, []))


def test_a_late_reports_listing_does_not_take_later_work_for_lost():
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=1, replica_timeout_s=60.0)
    core.on_report(report(1), 0.0)
    late = report(2, held=[])  # built at 0.5 with its listing; the call times out at the replica
    core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=20), 0, 0)], 0.6)
    (w,) = core.on_report(report(3), 1.0).start  # the resend's reply brings the Work: the replica runs it
    core.on_report(report(4, [SeqProgress(w.seq_id, w.attempt, [5, 6], offset=0)]), 1.2)
    core.on_report(late, 1.3)  # the router gets to the stuck call now
    seq = core.seqs[w.seq_id]
    assert core.counters.lost_orders == 0
    assert seq.status is SeqStatus.RUNNING and seq.attempt == w.attempt and seq.replica == "a"
