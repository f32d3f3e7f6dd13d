"""The fleet changes between and during batches (a replica replaced, the deployment scaled):
every policy still finishes every batch, and static deals its shares over the fleet it has."""
import pytest

from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.router_core import RouterCore
from rollout_cluster.types import EngineStats, ModelInfo, Report, SamplingSpec, SeqProgress, SequenceRequest

COST = load_profile("h200-1.5b", max_num_seqs=32)
POLICIES = ["static", "pull", "least-loaded", "chunked", "steal"]


class Fleet:
    """Replicas that finish whatever they are given at their next pull (3 tokens each)."""

    def __init__(self, policy: str, expected: int):
        self.core = RouterCore(make_policy(PolicyConfig(name=policy), COST), expected_replicas=expected,
                               replica_timeout_s=60.0)
        self.held = {}  # replica -> works
        self.now = 0.0

    def pull(self, rid, leaving=False):
        self.now += 0.1
        done = [SeqProgress(w.seq_id, w.attempt, [4, 5, 6], None, "length") for w in self.held.pop(rid, [])]
        report = Report(rid, f"{rid}-1", done, EngineStats(), ModelInfo(100, 64), 32, leaving=leaving)
        self.held[rid] = list(self.core.on_report(report, self.now).start)
        return self.held[rid]

    def run_batch(self, replicas, n=12, rounds=20):
        bid = self.core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=3), i // 2, i % 2) for i in range(n)],
                               self.now)
        firsts = {}
        for _ in range(rounds):
            for rid in replicas:
                for w in self.pull(rid):
                    firsts.setdefault(w.seq_id, rid)
            done, _, finished = self.core.fetch(bid, 0)
            if finished:
                assert len(done) == n and all(len(c.token_ids) == 3 for c in done)
                return firsts
        raise AssertionError(f"batch unfinished after {rounds} rounds: {len(self.core.fetch(bid, 0)[0])} of {n}")


def test_expected_fleet_size_follows_joins_and_leaves_not_deaths():
    fleet = Fleet("pull", expected=2)
    fleet.pull("a")
    assert fleet.core.expected_replicas == 2  # still starting: the configured size stands
    for rid in ("b", "c"):
        fleet.pull(rid)
    assert fleet.core.expected_replicas == 3
    fleet.core.remove_replica("c", fleet.now)  # died: Serve replaces it
    assert fleet.core.expected_replicas == 3
    fleet.pull("b", leaving=True)
    assert fleet.core.expected_replicas == 2 and set(fleet.core.replicas) == {"a"}
    fleet.pull("b", leaving=True)  # a goodbye said twice (or by a replica already declared dead)
    assert fleet.core.expected_replicas == 2 and fleet.core.counters["replica_leaves"] == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_a_replaced_replica_does_not_strand_the_next_batch(policy):
    fleet = Fleet(policy, expected=2)
    for rid in ("a", "b"):
        fleet.pull(rid)
    fleet.run_batch(["a", "b"])
    fleet.core.remove_replica("b", fleet.now)  # b died; Serve starts c in its place
    fleet.pull("c")
    used = fleet.run_batch(["a", "c"])
    if policy == "static":  # c took over b's share: half of the batch each
        assert sorted(list(used.values()).count(r) for r in ("a", "c")) == [6, 6]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_scaled_down_fleet_splits_the_next_batch_over_the_replicas_left(policy):
    fleet = Fleet(policy, expected=2)
    for rid in ("a", "b"):
        fleet.pull(rid)
    fleet.run_batch(["a", "b"])
    fleet.pull("b", leaving=True)  # Serve stopped b (scale-down): it said goodbye
    assert fleet.core.expected_replicas == 1
    used = fleet.run_batch(["a"])
    assert set(used.values()) == {"a"}


def test_static_shares_follow_a_scale_up():
    fleet = Fleet("static", expected=2)
    for rid in ("a", "b"):
        fleet.pull(rid)
    fleet.run_batch(["a", "b"])
    fleet.pull("c")  # the deployment was scaled up
    assert fleet.core.expected_replicas == 3
    used = fleet.run_batch(["a", "b", "c"])
    assert sorted(list(used.values()).count(r) for r in ("a", "b", "c")) == [4, 4, 4]
