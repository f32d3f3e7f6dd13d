"""The fleet changes between and during batches (a replica replaced, the deployment scaled):
every policy still finishes every batch, and static deals its shares over the fleet it has."""
import pytest

from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.router.core import RouterCore
from rollout_cluster.protocol import (EngineStats, ModelInfo, Report, SamplingSpec, SeqProgress, SequenceRequest,
                                      WeightsState)

COST = load_profile("h200-1.5b", max_num_seqs=32)
POLICIES = ["static", "pull", "least-loaded", "chunked", "steal"]


class Fleet:
    """Replicas that finish whatever they are given at their next pull (3 tokens each)."""

    def __init__(self, policy: str, expected: int):
        self.core = RouterCore(make_policy(PolicyConfig(name=policy), COST), expected_replicas=expected,
                               replica_timeout_s=60.0)
        self.held = {}  # replica -> works
        self.now = 0.0
        self.weights = {}  # replica -> the weights version it reports (0 unless set)

    def pull(self, rid, leaving=False):
        self.now += 0.1
        done = [SeqProgress(w.seq_id, w.attempt, [4, 5, 6], None, "length") for w in self.held.pop(rid, [])]
        report = Report(rid, f"{rid}-1", progress=done, stats=EngineStats(), model=ModelInfo(100, 64), capacity=32,
                        weights=WeightsState(version=self.weights.get(rid, 0)), leaving=leaving)
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
    assert fleet.core.fleet.expected == 2  # still starting: the configured size stands
    for rid in ("b", "c"):
        fleet.pull(rid)
    assert fleet.core.fleet.expected == 3
    fleet.pull("d")
    assert fleet.core.fleet.expected == 4
    fleet.core.remove_replica("d", fleet.now)  # a death takes back a join that raised the count
    assert fleet.core.fleet.expected == 3
    fleet.pull("d2")  # ...and its replacement puts it back
    assert fleet.core.fleet.expected == 4
    fleet.pull("d2", leaving=True)
    assert fleet.core.fleet.expected == 3 and set(fleet.core.fleet.replicas) == {"a", "b", "c"}
    fleet.pull("d2", leaving=True)  # a goodbye said twice (or by a replica already declared dead)
    assert fleet.core.fleet.expected == 3 and fleet.core.counters.replica_leaves == 1
    fleet.pull("d2")  # a late pull of the replica that left: not a new replica
    assert set(fleet.core.fleet.replicas) == {"a", "b", "c"} and fleet.core.fleet.expected == 3
    fleet.core.remove_replica("c", fleet.now)  # takes back the last join that raised the count
    assert fleet.core.fleet.expected == 2
    fleet.core.remove_replica("b", fleet.now)  # no such join left: Serve replaces it, the count stands
    assert fleet.core.fleet.expected == 2


def test_a_replacement_after_a_leave_is_no_surplus_and_a_dead_engine_keeps_the_count():
    """Regression (e2e, 2026-12-01): Serve replaced a replica gracefully (a leave, then its
    replacement's join), and a later death took the count from 2 to 1: the join had been counted as
    a replacement that came before a dead predecessor timed out."""
    fleet = Fleet("pull", expected=2)
    for rid in ("a", "b"):
        fleet.pull(rid)
    fleet.pull("b", leaving=True)
    assert fleet.core.fleet.expected == 1
    fleet.pull("b2")  # Serve's replacement
    assert fleet.core.fleet.expected == 2 and fleet.core.fleet.surplus_joins == 0
    fleet.core.remove_replica("a", fleet.now)  # a timed-out death: Serve replaces it
    assert fleet.core.fleet.expected == 2
    fleet.pull("a2")
    # an engine that died says goodbye itself: a death, and Serve's replacement comes after it
    report = Report("a2", "a2-1", progress=[], stats=EngineStats(), model=None, capacity=32, leaving=True,
                    engine_dead=True)
    fleet.core.on_report(report, fleet.now + 1)
    assert fleet.core.fleet.expected == 2 and set(fleet.core.fleet.replicas) == {"b2"}
    assert fleet.core.counters.replica_deaths == 2 and fleet.core.counters.replica_leaves == 1


def test_a_rolling_update_leaves_no_unfilled_leave_behind():
    """The replacement joins before the old replica leaves (surplus), then it leaves: nothing is
    left to refill, so a later early replacement still counts as surplus and its predecessor's
    timeout takes the count back."""
    fleet = Fleet("pull", expected=2)
    for rid in ("a", "b", "b2"):
        fleet.pull(rid)
    fleet.pull("b", leaving=True)
    assert fleet.core.fleet.expected == 2 and fleet.core.fleet.unfilled_leaves == 0
    fleet.pull("a2")  # a's replacement, before a timed out
    assert fleet.core.fleet.expected == 3
    fleet.core.remove_replica("a", fleet.now)
    assert fleet.core.fleet.expected == 2


def test_a_driver_target_is_the_count_before_the_fleet_moves_and_stays_through_it():
    """RolloutClient.scale tells the router the target as soon as Serve took it. The joins and
    leaves that follow change nothing; without the target, a scale-up's joins stay counted as early
    replacements, and the next death lowers the count below the fleet Serve keeps."""
    fleet = Fleet("pull", expected=2)
    for rid in ("a", "b"):
        fleet.pull(rid)
    fleet.core.set_fleet_target(4, fleet.now)
    assert fleet.core.fleet.expected == 4  # before the new replicas join
    for rid in ("c", "d"):
        fleet.pull(rid)
    assert fleet.core.fleet.expected == 4 and fleet.core.fleet.surplus_joins == 0
    fleet.core.remove_replica("d", fleet.now)  # a death: Serve replaces it, the count stands
    assert fleet.core.fleet.expected == 4
    fleet.pull("d2")
    fleet.core.set_fleet_target(2, fleet.now)
    assert fleet.core.fleet.expected == 2  # before any replica left
    for rid in ("c", "d2"):  # Serve stops two: their leaves do not lower the count again
        fleet.pull(rid, leaving=True)
    assert fleet.core.fleet.expected == 2 and fleet.core.fleet.unfilled_leaves == 0
    assert set(fleet.core.fleet.replicas) == {"a", "b"}
    fleet.pull("b", leaving=True)  # a leave below the count (declarative scale-down) still lowers it
    assert fleet.core.fleet.expected == 1
    fleet.pull("e")  # and a join above it raises it
    assert fleet.core.fleet.expected == 2


def test_a_driver_target_no_replica_comes_for_is_dropped_after_a_replica_timeout():
    fleet = Fleet("pull", expected=1)
    fleet.pull("a")
    fleet.core.set_fleet_target(3, fleet.now)
    fleet.now += 61  # past replica_timeout_s (60): the two never came (no node can host them)
    fleet.pull("a")
    fleet.core.expire(fleet.now)
    assert fleet.core.fleet.expected == 1


@pytest.mark.parametrize("policy", POLICIES)
def test_a_router_that_expects_more_replicas_than_come_settles_on_those_that_did(policy):
    """A router restarted after an in-place scale-down (num_replicas under deployments: lowered,
    args.replicas not) expects the old count. Once no replica has joined or died for a replica
    timeout, it takes the fleet it has, so chunked's first round and static's shares do not wait
    for ever; a replica that joins later raises the count again."""
    fleet = Fleet(policy, expected=3)
    timeout = fleet.core.fleet.replica_timeout_s
    for rid in ("a", "b"):
        fleet.pull(rid)
    fleet.core.expire(fleet.now + timeout / 2)
    assert fleet.core.fleet.expected == 3  # still within the timeout: the others may be starting
    fleet.now += timeout + 1
    for rid in ("a", "b"):
        fleet.pull(rid)  # alive
    fleet.core.expire(fleet.now)
    assert fleet.core.fleet.expected == 2
    fleet.run_batch(["a", "b"])
    fleet.pull("c")
    assert fleet.core.fleet.expected == 3


def test_a_death_gives_its_replacement_a_replica_timeout_before_the_count_drops():
    fleet = Fleet("pull", expected=2)
    fleet.pull("a"), fleet.pull("b")
    fleet.now += 1000
    fleet.pull("a")
    fleet.core.remove_replica("b", fleet.now)  # b died long after the last join
    fleet.core.expire(fleet.now + 1)
    assert fleet.core.fleet.expected == 2  # its replacement is expected
    fleet.pull("a")
    fleet.now += fleet.core.fleet.replica_timeout_s + 1
    fleet.pull("a")
    fleet.core.expire(fleet.now)
    assert fleet.core.fleet.expected == 1  # none came


@pytest.mark.parametrize("policy", POLICIES)
def test_a_replacement_that_joins_before_the_dead_replica_times_out_does_not_strand_a_batch(policy):
    fleet = fleet_after_a_batch(policy)
    fleet.pull("c")  # b crashed; its replacement is up before the router declares b dead
    assert fleet.core.fleet.expected == 3
    fleet.core.remove_replica("b", fleet.now)  # b times out
    assert fleet.core.fleet.expected == 2
    fleet.run_batch(["a", "c"])  # chunked's first round waits for the expected fleet: not for ever


def test_static_share_of_a_replica_without_the_current_weights_is_run_by_another():
    """b failed to load the weights: it keeps pulling but is hidden from the policy, and its share
    must not wait for it."""
    fleet = fleet_after_a_batch("static")
    fleet.core.weights.version = 1
    fleet.weights = {"a": 1, "b": 0}
    fleet.pull("a")
    fleet.pull("b")
    bid = fleet.core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=3), i // 2, i % 2) for i in range(8)],
                            fleet.now)
    assert len(fleet.pull("a")) == 4 and fleet.pull("b") == []
    fleet.now += 31.0
    assert len(fleet.pull("a")) == 4
    fleet.pull("a")
    done, _, finished = fleet.core.fetch(bid, 0)
    assert finished and len(done) == 8


def fleet_after_a_batch(policy: str) -> Fleet:
    """Replicas a and b (the configured 2) that have run one batch."""
    fleet = Fleet(policy, expected=2)
    for rid in ("a", "b"):
        fleet.pull(rid)
    fleet.run_batch(["a", "b"])
    return fleet


@pytest.mark.parametrize("policy", POLICIES)
def test_a_replaced_replica_does_not_strand_the_next_batch(policy):
    fleet = fleet_after_a_batch(policy)
    fleet.core.remove_replica("b", fleet.now)  # b died; Serve starts c in its place
    fleet.pull("c")
    used = fleet.run_batch(["a", "c"])
    if policy == "static":  # c took over b's share: half of the batch each
        assert sorted(list(used.values()).count(r) for r in ("a", "c")) == [6, 6]


@pytest.mark.parametrize("policy", POLICIES)
def test_a_scaled_down_fleet_splits_the_next_batch_over_the_replicas_left(policy):
    fleet = fleet_after_a_batch(policy)
    fleet.pull("b", leaving=True)  # Serve stopped b (scale-down): it said goodbye
    assert fleet.core.fleet.expected == 1
    used = fleet.run_batch(["a"])
    assert set(used.values()) == {"a"}


def test_static_shares_follow_a_scale_up():
    fleet = fleet_after_a_batch("static")
    fleet.pull("c")  # the deployment was scaled up
    assert fleet.core.fleet.expected == 3
    used = fleet.run_batch(["a", "b", "c"])
    assert sorted(list(used.values()).count(r) for r in ("a", "b", "c")) == [4, 4, 4]


def test_a_sim_engine_slowed_down_reports_wall_time_steps():
    """engine.sim_time_scale: the modelled step is stretched in wall time, and the step time the
    replica reports (which the steal policy compares with its cost model) is the wall time."""
    import asyncio

    from rollout_cluster.config import ClusterConfig, EngineConfig
    from rollout_cluster.engines.factory import make_engine
    from rollout_cluster.protocol import Work

    async def step_times(scale):
        cfg = ClusterConfig(engine=EngineConfig(kind="sim", sim_profile="h200-1.5b", max_num_seqs=8,
                                                sim_time_scale=scale)).validate()
        eng = make_engine(cfg)
        await eng.start()
        eng.submit(Work("s", 1, [1] * 40, SamplingSpec(max_tokens=10_000), None, prompt_len=40))
        eng.core.advance(max_steps=3)
        out = (eng.core.last_step_s, eng.stats().step_time_s)
        await eng.shutdown()
        return out

    modelled, reported = asyncio.run(step_times(3.0))
    assert modelled > 0 and reported == pytest.approx(3.0 * modelled)
    modelled, reported = asyncio.run(step_times(1.0))
    assert reported == pytest.approx(modelled)


def test_a_sim_engine_held_off_the_cpu_catches_up_with_the_wall_clock():
    """A replica process descheduled for a while (32 replicas on a 2-core host) must not fall
    behind for good: the real-time sim engine runs the steps it owes when it gets the CPU back."""
    import asyncio
    import time

    from rollout_cluster.engines.sim_engine import SimEngine
    from rollout_cluster.protocol import Work

    async def modelled_after_a_stall():
        eng = SimEngine(load_profile("h200-1.5b", max_num_seqs=8))
        await eng.start()
        eng.submit(Work("s", 1, [1] * 40, SamplingSpec(max_tokens=1_000_000), None, prompt_len=40))
        await asyncio.sleep(0.05)
        time.sleep(0.4)  # the whole process off the CPU: the engine's loop cannot run
        await asyncio.sleep(0.05)
        out = eng.modelled_s
        await eng.shutdown()
        return out

    # 0.5 s of wall time passed; without catching up only the 0.1 s of awake time would be modelled
    assert asyncio.run(modelled_after_a_stall()) >= 0.4


def test_static_runs_a_share_whose_replica_never_comes_after_a_while():
    """The expected fleet can stay above the live one (a replacement joined before the dead
    replica timed out): a share nobody claims is run by a replica that finished its own."""
    fleet = Fleet("static", expected=2)
    fleet.pull("a")
    bid = fleet.core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=3), i // 2, i % 2) for i in range(8)],
                            fleet.now)
    assert len(fleet.pull("a")) == 4  # its share; the other waits for a second replica
    assert fleet.pull("a") == []  # finished its own; the other share has not waited long enough
    fleet.now += 31.0
    assert len(fleet.pull("a")) == 4  # nobody came: it runs the other share
    fleet.pull("a")
    done, _, finished = fleet.core.fetch(bid, 0)
    assert finished and len(done) == 8
