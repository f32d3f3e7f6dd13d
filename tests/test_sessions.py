"""Session affinity (router/sessions.py, policy/pull.py): a session's next turn goes to the replica
that ran its previous one while that replica has a free slot, to anyone otherwise (home full or
gone), never twice; other work is placed as before. RouterCore driven directly, seeded."""
import random

import pytest

from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import EngineStats, InputError, ModelInfo, Report, SamplingSpec, SeqProgress, SequenceRequest
from rollout_cluster.router.core import RouterCore
from rollout_cluster.router.sessions import SessionHomes

COST = load_profile("h200-1.5b", max_num_seqs=8)


class Fleet:
    """Replicas that run what they are given and finish it when told."""

    def __init__(self, policy="pull", replicas=("a", "b"), capacity=8, max_sessions=65536, **pc):
        self.core = RouterCore(make_policy(PolicyConfig(name=policy, **pc), COST), expected_replicas=len(replicas),
                               replica_timeout_s=5.0, max_sessions=max_sessions)
        self.capacity, self.now = capacity, 0.0
        self.running = {rid: [] for rid in replicas}
        self.placed = {}  # seq_id -> replica it started on
        for rid in replicas:
            self.pull(rid, model=ModelInfo(1000, 4096))

    def pull(self, rid, finish=False, model=None):
        self.now += 0.01
        progress = []
        if finish:
            progress = [SeqProgress(w.seq_id, w.attempt, [7, 8], None, "length", cached_tokens=0)
                        for w in self.running[rid]]
            self.running[rid] = []
        orders = self.core.on_report(Report(rid, "i1", progress=progress, stats=EngineStats(), model=model,
                                            capacity=self.capacity), self.now)
        for w in orders.start:
            assert w.seq_id not in self.placed or self.placed[w.seq_id] != rid or w.attempt > 1
            self.placed[w.seq_id] = rid
        self.running[rid] += orders.start
        return orders

    def turn(self, sessions, order):
        """Submit one turn (a sequence per session), pull in `order` until it is placed, finish it."""
        bid = self.core.submit([SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=2), i, 0, session=s)
                                for i, s in enumerate(sessions)], self.now)
        for rid in order:
            self.pull(rid)
        assert not self.core.queue, "every turn placed"
        for rid in self.running:
            self.pull(rid, finish=True)
        done, _, finished = self.core.fetch(bid, 0, self.now)
        assert finished and len(done) == len(sessions)
        self.core.release(bid)
        return {s: c.replicas[0] for s, c in zip(sessions, sorted(done, key=lambda c: c.prompt_index))}


def test_the_next_turn_goes_home_even_when_another_replica_pulls_first():
    fleet = Fleet()
    sessions = [f"agent-{i}" for i in range(6)]
    first = fleet.turn(sessions, order=["a", "b"])
    assert sorted(first.values()) == ["a"] * 3 + ["b"] * 3  # fair shares, as without sessions
    second = fleet.turn(sessions, order=["b", "a"])  # b pulls first: it takes only its own sessions
    assert second == first
    assert fleet.core.sessions.status() == {"sessions": 6, "homed_turns": 6, "unhomed_turns": 6}


def test_without_sessions_the_first_puller_takes_its_share():
    fleet = Fleet()
    ids = [None] * 6
    fleet.turn(ids, order=["a", "b"])
    bid = fleet.core.submit([SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=2), i, 0) for i in range(6)], 1.0)
    assert len(fleet.pull("b").start) == 3  # no home holds anything back
    assert fleet.core.sessions.status() == {"sessions": 0, "homed_turns": 0, "unhomed_turns": 0}


def test_a_full_home_leaves_its_turns_to_others_and_a_home_with_room_takes_them_past_its_share():
    fleet = Fleet(capacity=4)
    sessions = [f"s{i}" for i in range(8)]
    first = fleet.turn(sessions, order=["a", "b"])
    on_a = [s for s in sessions if first[s] == "a"]
    assert len(on_a) == 4
    # Turn 2 for a's sessions only: 4 turns, all homed on a (which has 4 free slots).
    bid = fleet.core.submit([SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=2), i, 0, session=s)
                             for i, s in enumerate(on_a)], fleet.now)
    assert fleet.pull("b").start == []  # a has room for all four: b leaves them
    assert len(fleet.pull("a").start) == 4  # past its even share (2): they are its sessions
    for rid in ("a", "b"):
        fleet.pull(rid, finish=True)
    # Fill a with other work, then the next turns of its sessions go to b.
    fleet.core.submit([SequenceRequest([1], SamplingSpec(max_tokens=2), i, 0) for i in range(4)], fleet.now)
    assert len(fleet.pull("a").start) == 2  # its even share of the 4
    turns = fleet.core.submit([SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=2), i, 0, session=s)
                               for i, s in enumerate(on_a)], fleet.now)
    assert [w.seq_id.split(":")[0] for w in fleet.pull("a").start] == [turns] * 2  # two free slots: two turns
    taken_by_b = fleet.pull("b").start
    assert len(taken_by_b) == 4  # a is full: its other two turns, and the other batch's two left
    assert sum(1 for w in taken_by_b if w.seq_id.split(":")[0] == turns) == 2


def test_a_dead_homes_turns_go_elsewhere_and_the_session_moves_with_them():
    fleet = Fleet()
    sessions = ["x", "y", "z", "w"]
    first = fleet.turn(sessions, order=["a", "b"])
    on_a = [s for s in sessions if first[s] == "a"]
    # a dies while its sessions' next turns are queued for it: once it is declared dead, b takes them.
    bid = fleet.core.submit([SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=2), i, 0, session=s)
                             for i, s in enumerate(on_a)], fleet.now)
    assert fleet.pull("b").start == []
    fleet.now += 4
    fleet.pull("b")
    fleet.now += 4  # a stopped pulling: past replica_timeout_s (5 s) it is dead
    assert fleet.core.expire(fleet.now) == ["a"]
    fleet.running.pop("a")
    assert len(fleet.pull("b").start) == len(on_a)
    fleet.pull("b", finish=True)
    assert fleet.core.fetch(bid, 0, fleet.now)[2]
    # the sessions live on b now; a session whose home is gone at submit is placed anywhere
    assert fleet.turn(sessions, order=["b"]) == {s: "b" for s in sessions}


@pytest.mark.parametrize("policy", ["pull", "steal"])
@pytest.mark.parametrize("seed", range(5))
def test_seeded_multi_turn_runs_place_every_turn_at_home_when_there_is_room(policy, seed):
    """Random pull orders, sessions of 2-5 turns joining and leaving: with room everywhere (capacity
    above the load) every turn after the first lands at home; nothing is lost or returned twice."""
    rng = random.Random(seed)
    fleet = Fleet(policy=policy, replicas=("a", "b", "c"), capacity=64)
    live = {f"s{i}": rng.randint(2, 5) for i in range(12)}
    homes, later_turns, at_home, made = {}, 0, 0, 0
    while live:
        sessions = sorted(live)
        order = rng.sample(["a", "b", "c"], 3)
        placed = fleet.turn(sessions, order=order * 2)
        made += len(sessions)
        for s, rid in placed.items():
            if s in homes:
                later_turns += 1
                at_home += rid == homes[s]
            homes[s] = rid
            live[s] -= 1
            if not live[s]:
                del live[s]
        if rng.random() < 0.3:
            live[f"n{made}"] = rng.randint(2, 5)
    assert later_turns > 20 and at_home == later_turns
    assert fleet.core.counters.generated_tokens == 2 * made  # every turn once


def test_session_ids_are_checked_and_the_map_is_bounded():
    fleet = Fleet(max_sessions=2)
    bid = fleet.core.submit([SequenceRequest([1], SamplingSpec(max_tokens=2), 0, 0, session=""),
                             SequenceRequest([1], SamplingSpec(max_tokens=2), 1, 0, session=7),
                             SequenceRequest([1], SamplingSpec(max_tokens=2), 2, 0, session="x" * 257)], 0.0)
    done, _, finished = fleet.core.fetch(bid, 0, 0.0)
    assert finished and all(c.finish_reason == "error" and "session" in c.error for c in done)
    homes = SessionHomes(max_sessions=2)
    for s, rid in (("p", "a"), ("q", "b"), ("r", "a")):
        homes.record(s, rid)
    assert list(homes.homes) == ["q", "r"]  # the least recently used went first
    assert homes.home("p", {"a", "b"}) is None and homes.home("q", {"a"}) is None  # forgotten; home gone
    assert homes.home("r", {"a"}) == "a"
    with pytest.raises(InputError, match="session"):
        from rollout_cluster.client.expand import expand
        expand([[1], [2]], SamplingSpec(), sessions=["only-one"])
