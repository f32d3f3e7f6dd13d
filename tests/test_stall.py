"""Liveness (issue 24): a replica that holds running sequences and reports no new token for
router.stall_timeout_s (its engine paused or hung while its pull loop goes on) is declared stalled.
Its sequences continue elsewhere from their last reported tokens, as a dead replica's do; its
later pulls are answered with Orders.stop and none of their reports is applied; its pull loop
ends, its health check fails (Serve replaces it) and it hands nothing back at shutdown. Every
sequence completes once. The router core is pure: time is an argument here."""
import asyncio
import random

import pytest

from rollout_cluster.config import (ClusterConfig, ConfigError, EngineConfig, PolicyConfig, RouterConfig, load_config,
                                    to_dict)
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import EngineStats, ModelInfo, Report, SamplingSpec, SeqProgress, SequenceRequest
from rollout_cluster.router.core import STALLED, RouterCore
from rollout_cluster.serve.engine_moves import EngineMoves
from rollout_cluster.serve.pull_loop import PullLoop
from rollout_cluster.serve.replica import EngineReplica
from rollout_cluster.serve.router import Router
from rollout_cluster.serve.stall_watch import StallWatch
from router_support import pull as signed_pull

T = 10.0  # the stall timeout of these tests
COST = load_profile("a100-80g-7b")


def core_of(stall_timeout_s: float = T, replicas: int = 2) -> RouterCore:
    return RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=replicas,
                      replica_timeout_s=1e9, stall_timeout_s=stall_timeout_s)


def report(rid: str, progress=(), leaving: bool = False, inc: str = "i1") -> Report:
    return Report(rid, inc, progress=list(progress), stats=EngineStats(), model=ModelInfo(100, 64), capacity=8,
                  leaving=leaving)


def tok(seq_id: str, attempt: int = 1, tokens=(7,), offset: int = 0, reason=None) -> SeqProgress:
    return SeqProgress(seq_id, attempt, list(tokens), None, reason, offset=offset)


def submit(core: RouterCore, n: int, max_tokens: int = 6, now: float = 0.0) -> str:
    return core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=max_tokens), 0, j) for j in range(n)], now)


def one_running_on_a(now: float = 0.0):
    """A core with replica a running one sequence dispatched at `now` (b not yet joined)."""
    core = core_of()
    core.on_report(report("a"), now)
    bid = submit(core, 1, now=now)
    (w,) = core.decide("a", now).start
    return core, bid, w


# ---- detection ----------------------------------------------------------------------------------
def test_a_stall_is_declared_just_after_the_timeout_and_not_before():
    core, _, w = one_running_on_a()
    core.on_report(report("a", [tok(seq_id=w.seq_id, tokens=[4, 5])]), 3.0)  # progress at 3
    assert core.fleet.stalled(3.0 + T, T) == [] and core.check_stalls(3.0 + T) == []
    assert core.check_stalls(3.0 + T + 1e-6) == ["a"]
    assert "a" not in core.fleet.replicas and core.counters.replica_stalls == 1
    assert core.check_stalls(1e9) == []  # once


def test_the_first_running_sequence_starts_the_clock_not_the_join():
    core = core_of()
    core.on_report(report("a"), 0.0)  # joined at 0, idle until 100
    submit(core, 1, now=100.0)
    core.decide("a", 100.0)
    assert core.check_stalls(100.0 + T) == []
    assert core.check_stalls(100.0 + T + 0.5) == ["a"]


def test_a_replica_that_reports_tokens_is_never_stalled():
    core, bid, w = one_running_on_a()
    for k in range(1, 5 * int(T)):  # a token a second for 5 timeouts
        orders = core.on_report(report("a", [tok(seq_id=w.seq_id, tokens=[3], offset=k - 1)]), float(k))
        assert not orders.stop
        assert core.check_stalls(float(k) + 0.99) == []
    assert core.counters.replica_stalls == 0


def test_reports_without_tokens_do_not_count_as_progress():
    core, _, w = one_running_on_a()
    for k in range(1, int(T) + 1):  # pulls, but nothing new
        assert not core.on_report(report("a"), float(k)).stop
    orders = core.on_report(report("a"), T + 0.5)  # detected at its own report, not only at a tick
    assert orders.stop == STALLED and not orders.start
    assert core.counters.replica_stalls == 1 and core.seqs[w.seq_id].replica is None


def test_an_idle_replica_is_never_stalled():
    core = core_of()
    core.on_report(report("a"), 0.0)
    assert core.check_stalls(1e9) == [] and not core.on_report(report("a"), 1e9).stop
    # nor one whose sequences all ended: it holds nothing
    bid = submit(core, 1, now=1e9)
    (w,) = core.decide("a", 1e9).start
    core.on_report(report("a", [tok(seq_id=w.seq_id, tokens=[1] * 6, reason="length")]), 1e9 + 1)
    assert core.fetch(bid, 0)[2] and core.check_stalls(1e10) == []


def test_zero_never_declares_a_stall():
    core = core_of(stall_timeout_s=0.0)
    core.on_report(report("a"), 0.0)
    submit(core, 1)
    core.decide("a", 0.0)
    assert core.check_stalls(1e12) == [] and not core.on_report(report("a"), 1e12).stop


def test_a_stall_counts_neither_as_a_death_nor_a_leave_and_the_fleet_keeps_its_size():
    core, _, _ = one_running_on_a()
    core.on_report(report("b"), 0.0)
    assert core.check_stalls(T + 1) == ["a"]
    c = core.counters
    assert (c.replica_stalls, c.replica_deaths, c.replica_leaves, c.recovered) == (1, 0, 0, 1)
    assert core.fleet.expected == 2  # Serve replaces it
    core.on_report(report("a2"), T + 2)  # its replacement fills the place
    assert core.fleet.expected == 2 and len(core.fleet.replicas) == 2


# ---- the work continues once ----------------------------------------------------------------------
def test_requeued_work_continues_from_its_partial_tokens_once_despite_late_reports():
    core, bid, w = one_running_on_a()
    core.on_report(report("a", [tok(seq_id=w.seq_id, tokens=[4, 5])]), 1.0)
    core.on_report(report("b"), 1.0)
    assert core.check_stalls(1.0 + T + 0.1) == ["a"]
    (w2,) = core.on_report(report("b"), 12.0).start
    assert w2.seq_id == w.seq_id and w2.attempt == 2
    assert w2.prompt_token_ids == [1, 2, 4, 5] and w2.sampling.max_tokens == 4
    # the stalled replica wakes up: its tokens, its final, its listing and its goodbye are refused
    late = [tok(seq_id=w.seq_id, tokens=[6, 7], offset=2), tok(seq_id=w.seq_id, tokens=[8, 9], offset=4,
                                                                 reason="length")]
    for r in (report("a", late), report("a", late, leaving=True)):
        orders = core.on_report(r, 13.0)
        assert orders.stop == STALLED and not orders.start
    seq = core.seqs[w.seq_id]
    assert seq.generated == 2 and seq.replica == "b" and "a" not in core.fleet.replicas
    assert core.counters.generated_tokens == 2
    core.on_report(report("b", [tok(seq_id=w.seq_id, attempt=2, tokens=[1, 1, 1, 1], reason="length")]), 14.0)
    new, _, done = core.fetch(bid, 0)
    (c,) = new
    assert done and c.token_ids == [4, 5, 1, 1, 1, 1] and c.replicas == ["a", "b"]
    assert [(m.source, m.destination, m.at_token, m.reason) for m in c.migrations] == [("a", "b", 2, "replica_lost")]
    assert core.counters.replica_stalls == 1  # the late pulls counted nothing again
    # a new incarnation of it (the process restarted) is a new replica, not a stalled one
    assert not core.on_report(report("a", inc="i2"), 15.0).stop and "a" in core.fleet.replicas


def test_a_stall_releases_the_continuations_reserved_for_it():
    """Work a policy's give-up reserved for the stalled replica goes back to every replica."""
    core = core_of()
    for rid in ("a", "b"):
        core.on_report(report(rid), 0.0)
    submit(core, 1)
    (wa,) = core.decide("a", 0.0).start
    submit(core, 1)
    (wb,) = core.decide("b", 0.0).start
    seq = core.seqs[wb.seq_id]
    core.moves.give_up_t[seq.seq_id] = (0.5, "a")  # a migration to "a", as steal orders them
    core.moves.order_give_up(seq)
    assert core.decide("b", 0.5).give_up == [(wb.seq_id, 1)]
    core.on_report(report("b", [tok(seq_id=wb.seq_id, tokens=[3], reason="abort")]), 1.0)
    assert list(core.queue.reserved["a"]) == [wb.seq_id]
    assert core.check_stalls(T + 0.1) == ["a"]
    assert "a" not in core.queue.reserved
    starts = core.decide("b", T + 0.2).start
    assert sorted(w.seq_id for w in starts) == sorted([wa.seq_id, wb.seq_id])
    assert next(w for w in starts if w.seq_id == wb.seq_id).prompt_token_ids == [1, 2, 3]


# ---- the serve side: the pull loop ends, the health check fails, nothing is handed back ------------
class FrozenEngine:
    """A replica's engine whose core is paused: it holds what it was given and makes no token."""

    capacity = 8
    ended = 0
    dead = None

    def __init__(self):
        self.works, self.given_up, self.shut = [], [], False

    def submit(self, work):
        self.works.append(work)

    def held(self):
        return [(w.seq_id, w.attempt) for w in self.works]

    def aborting(self):
        return []

    def drain(self):
        return []

    def stats(self):
        return EngineStats(running=len(self.works))

    def report_whole(self, keys):
        pass

    def whole_final(self, p):
        return p

    def forget_finals(self, delivered):
        pass

    async def give_up(self, keys):
        self.given_up += keys

    async def shutdown(self):
        self.shut = True


class BareReplica(EngineReplica.func_or_class):
    def __del__(self):  # garbage collection: the test calls the real one itself
        pass


def test_a_stalled_replica_stops_pulling_fails_its_health_check_and_hands_nothing_back():
    core = core_of()
    clock = iter(float(k) / 2 for k in range(10_000))  # half a second per look at the clock
    now = [0.0]

    def tick():
        now[0] = next(clock)
        return now[0]

    reports = []

    async def pull(r):
        reports.append(r)
        return core.on_report(r, now[0])

    engine = FrozenEngine()
    r = object.__new__(BareReplica)
    r.cfg, r.engine, r.replica_id, r.incarnation = ClusterConfig(), engine, "a", "i1"
    r.moves = EngineMoves(engine, r.cfg, "a")
    r.pull_loop = PullLoop(engine, r.moves, pull, replica_id="a", incarnation="i1", model=ModelInfo(100, 64),
                           router_cfg=r.cfg.router, clock=tick)
    r.timeline = None
    core.on_report(report("a"), 0.0)
    bid = submit(core, 2)

    async def go():
        r.task = asyncio.get_running_loop().create_task(r.pull_loop.run())
        await asyncio.wait_for(asyncio.shield(r.task), 10)
        pulls = len(reports)
        await EngineReplica.func_or_class.__del__(r)  # what Serve's replacement of it calls
        return pulls

    pulls = asyncio.run(go())
    assert len(engine.works) == 2 and r.pull_loop.stalled and r.pull_loop.unsent == []
    with pytest.raises(RuntimeError, match="declared this replica stalled"):
        r.check_health()
    # the shutdown gave nothing up, sent no goodbye, and stopped the engine
    assert engine.given_up == [] and len(reports) == pulls and engine.shut
    assert core.counters.replica_stalls == 1 and core.counters.replica_deaths == 0
    # both continue on b, from the start (no token was made), and complete once
    starts = core.on_report(report("b"), now[0] + 1).start
    assert sorted(w.seq_id for w in starts) == sorted(w.seq_id for w in engine.works)
    for w in starts:
        core.on_report(report("b", [tok(seq_id=w.seq_id, attempt=w.attempt, tokens=[9] * 6, reason="length")]),
                       now[0] + 2)
    new, _, done = core.fetch(bid, 0)
    assert done and sorted(c.index for c in new) == [0, 1] and all(c.token_ids == [9] * 6 for c in new)


def test_the_serve_router_answers_a_stalled_replica_with_stop_and_its_watch_finds_one_that_pulls_no_more():
    import time

    cfg = ClusterConfig(replicas=2, engine=EngineConfig(kind="sim"), router=RouterConfig(stall_timeout_s=T))

    async def go():
        router = Router.func_or_class(to_dict(cfg))
        try:
            core = router.core
            assert core.stall_timeout_s == T and isinstance(router.stalls, StallWatch)
            past = time.monotonic() - 2 * T  # their work started two timeouts ago
            for rid in ("a", "b"):
                await signed_pull(router, report(rid))
            submit(core, 2, now=past)
            for rid in ("a", "b"):
                core.decide(rid, past)
            assert all(len(rep.seqs) == 1 for rep in core.fleet.replicas.values())
            first = await signed_pull(router, report("a"))  # at its report
            assert first.stop == STALLED and "a" not in router.credentials
            found = router.stalls.tick(time.monotonic())  # b pulled no more: the periodic look
            return first, found, core
        finally:
            router._reaper.cancel()

    first, found, core = asyncio.run(go())
    assert found == ["b"] and core.counters.replica_stalls == 2 and len(core.queue) == 2


# ---- the config ---------------------------------------------------------------------------------
@pytest.mark.parametrize("router, ok", [
    ({"stall_timeout_s": 0}, True),  # never
    ({"stall_timeout_s": 10}, True),  # twice the longest report interval (5 s) at the default timeout
    ({"stall_timeout_s": 9.5}, False),
    ({"stall_timeout_s": 4, "replica_timeout_s": 8}, True),  # the interval is at most 8 / 4 = 2 s
    ({"stall_timeout_s": 3.9, "replica_timeout_s": 8}, False),
    ({"stall_timeout_s": -1}, False),
    ({"stall_timeout_s": float("inf")}, False),
    ({"stall_timeout_s": float("nan")}, False),
])
def test_the_stall_timeout_is_zero_or_longer_than_two_report_intervals(router, ok):
    if ok:
        assert load_config({"router": router}).router.stall_timeout_s == router["stall_timeout_s"]
        return
    with pytest.raises(ConfigError, match="router.stall_timeout_s="):
        load_config({"router": router})


# ---- chaos: engines freeze and wake at random, and every sequence completes once, exactly -----------
def expected_token(index: int, position: int) -> int:
    return (7 * index + position) % 97


def fresh() -> dict:
    return {"frozen_until": -1.0, "held": {}}


def step(st: dict, t: float) -> list:
    """A replica's report at `t`: a token per held sequence, unless its engine is frozen."""
    if t < st["frozen_until"]:
        return []
    progress = []
    for key, (w, made) in list(st["held"].items()):
        idx = int(w.seq_id.rsplit(":", 1)[1])
        pos = w.prompt_len - 2 + made  # (its prompt is 2 tokens; a continuation's holds the partial)
        reason = "length" if made + 1 >= w.sampling.max_tokens else None
        progress.append(SeqProgress(w.seq_id, w.attempt, [expected_token(idx, pos)], None, reason, offset=made))
        if reason:
            del st["held"][key]
        else:
            st["held"][key] = (w, made + 1)
    return progress


@pytest.mark.parametrize("seed", range(6))
def test_random_freezes_complete_every_sequence_once_with_its_exact_tokens(seed):
    """Replicas pull every 0.5 s and make a token a pull per sequence, unless frozen; a frozen one
    keeps pulling. A stalled one is replaced (a new id), but may not hear its stop at once (a lost
    reply): it wakes and keeps reporting its old work for a while, and none of that may count.
    Tokens depend on their position, so a continuation that lost or repeated one shows."""
    rng = random.Random(seed)
    core = core_of(stall_timeout_s=3.0, replicas=3)
    n, max_tokens = 24, 30
    reps = {f"r{i}": fresh() for i in range(3)}
    for rid in reps:
        core.on_report(Report(rid, "i0", stats=EngineStats(), model=ModelInfo(100, 64), capacity=4), 0.0)
    bid = submit(core, n, max_tokens=max_tokens)
    zombies: dict = {}  # stalled replicas still reporting: rid -> (state, pulls left)
    got, cursor, t, replaced, late_pulls = {}, 0, 0.0, 0, 0
    while len(got) < n:
        assert t < 500, "the batch did not complete"
        t += 0.5
        for rid, st in list(reps.items()):
            if rng.random() < 0.05 and t >= st["frozen_until"]:
                st["frozen_until"] = t + rng.choice([1.0, 2.0, 5.0, 10.0])  # some pass the timeout
            orders = core.on_report(Report(rid, "i0", progress=step(st, t), stats=EngineStats(),
                                           model=ModelInfo(100, 64), capacity=4), t)
            if orders.stop:  # Serve replaces it: a new replica under a new id
                assert orders.stop == STALLED and not orders.start
                del reps[rid]
                st["frozen_until"] = -1.0  # it wakes up
                zombies[rid] = (st, rng.choice([0, 1, 4]))
                replaced += 1
                reps[f"n{replaced}"] = fresh()
                continue
            for w in orders.start:
                st["held"][(w.seq_id, w.attempt)] = (w, 0)
        for rid, (st, left) in list(zombies.items()):
            if left:
                assert core.on_report(Report(rid, "i0", progress=step(st, t), stats=EngineStats(), model=None,
                                             capacity=4), t).stop == STALLED
                late_pulls += 1
                zombies[rid] = (st, left - 1)
        core.check_stalls(t)
        new, cursor, _ = core.fetch(bid, cursor)
        for c in new:
            assert c.index not in got  # never twice
            got[c.index] = c
    assert replaced and core.counters.replica_stalls == replaced and core.counters.replica_deaths == 0
    assert late_pulls and core.counters.stale_reports == 0  # the late reports were refused whole, unapplied
    for i, c in got.items():
        assert c.finish_reason == "length"
        assert list(c.token_ids) == [expected_token(i, p) for p in range(max_tokens)], (i, c.migrations)
