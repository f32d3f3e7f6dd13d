"""The replica's moves and pull loop at their edges (serve/engine_moves.py, pull_loop.py,
timeline.py), without Ray: a restarted router's prefix-cache reset is a new order, a superseded
sleep move's failure leaves no error, an engine whose weights a stopped push left a mix runs no
work and leaves the fleet, and the timeline has a line for every pull, timed from its start."""
import asyncio
import json

from rollout_cluster.config import ClusterConfig, EngineConfig, PolicyConfig, RouterConfig
from rollout_cluster.engines.base import WeightsLoadBroken
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import (EngineStats, LoadWeights, ModelInfo, Orders, Report, ResetPrefixCache,
                                      SamplingSpec, SeqProgress, SequenceRequest, Sleep, StopPush, Wake, Work)
from rollout_cluster.router.core import RouterCore
from rollout_cluster.serve.engine_moves import EngineMoves
from rollout_cluster.serve.pull_loop import PullLoop
from rollout_cluster.serve.timeline import Timeline

from test_push_abort import MixingEngine, pushed
from rollout_cluster.transfer.push import PUSH_SCHEME

MODEL = ModelInfo(100, 64)
COST = load_profile("h200-1.5b", max_num_seqs=8)
PUSH = f"{PUSH_SCHEME}review1"


class Idle:
    """The part of an engine a pull loop reads: nothing running, nothing to report."""

    capacity, dead, ended = 8, None, 0

    def __init__(self):
        self.calls: list = []
        self.started: list = []

    def drain(self) -> list:
        return []

    def held(self) -> list:
        return [(w.seq_id, w.attempt) for w in self.started]

    def aborting(self) -> list:
        return []

    def stats(self) -> EngineStats:
        return EngineStats()

    def whole_final(self, p):
        return p

    def forget_finals(self, delivered) -> None:
        pass

    def report_whole(self, keys) -> None:
        pass

    async def give_up(self, keys) -> None:
        pass

    def submit(self, work) -> None:
        self.started.append(work)


def loop_over(engine, moves, pull, router_cfg=None, timeline=None) -> PullLoop:
    return PullLoop(engine, moves, pull, replica_id="a", incarnation="i1", model=MODEL,
                    router_cfg=router_cfg or RouterConfig(), timeline=timeline)


# ---- ResetPrefixCache across a router restart ---------------------------------------------------
class CacheEngine(Idle):
    async def reset_prefix_cache(self) -> bool:
        self.calls.append("reset")
        return True


def test_a_restarted_routers_reset_prefix_cache_is_not_ignored_as_a_resent_order():
    """engine_moves.py `_reset_cache` drops every ResetPrefixCache whose number is <= the last one
    taken, as "a resent order". But the router numbers those orders from 1 in each RouterCore
    (router/control.py `cache_resets`, never persisted or learned back), so after a router restart
    the new router's first orders carry numbers the replica has already taken from the old one,
    and the replica silently does nothing: RolloutClient.reset_prefix_cache() (TRL's
    /reset_prefix_cache) answers "N replicas ordered" while no engine drops its cache, until the
    new router has made more resets than the old one did. (Digest asks do not have this problem:
    they carry the router's id_prefix.) Right: an order of another router is a new order; only the
    same router's resend is ignored."""
    eng = CacheEngine()
    moves = EngineMoves(eng, ClusterConfig(engine=EngineConfig(model="models/none")), "a")
    routers = [RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=1, id_prefix=p)
               for p in ("old-", "new-")]
    current = {"core": routers[0]}

    async def pull(report):
        core = current["core"]
        orders = core.on_report(report, 1.0)
        orders.router_id = core.id_prefix  # (the Serve router names itself)
        return orders

    async def go():
        loop = loop_over(eng, moves, pull)
        await loop.step()  # joins the first router
        routers[0].reset_prefix_cache()
        await loop.step()
        await asyncio.sleep(0.05)
        assert eng.calls == ["reset"]
        current["core"] = routers[1]  # the router restarted
        await loop.step()  # joins the new one
        assert routers[1].reset_prefix_cache() == 1
        orders_seen = await loop.pull(loop.build_report(2.0))
        assert [c for c in orders_seen.control if isinstance(c, ResetPrefixCache)] == [ResetPrefixCache(1, "new-")]
        await loop.apply(orders_seen, [])
        await asyncio.sleep(0.05)

    asyncio.run(go())
    assert eng.calls == ["reset", "reset"], eng.calls  # the new router's reset was taken


# ---- a failed sleep move's error outlives the move ordered after it --------------------------------
class SleepSaysAwake(Idle):
    """Going to sleep takes a while and ends with the engine saying it is awake (as test_replica_sleep's
    lying engine): that move fails. Waking works."""

    async def sleep(self, level):
        self.calls.append(("sleep", level))
        await asyncio.sleep(0.05)

    async def wake(self):
        self.calls.append(("wake",))

    async def sleeping(self):
        return False


def test_a_wake_that_succeeds_after_a_failed_sleep_leaves_no_error_and_starts_the_work_sent():
    """A Wake taken while the Sleep before it still runs clears `sleep_error` when it is ordered
    (engine_moves.py `_move`), but the Sleep's task then fails and writes its error afterwards
    (`_move_sleep`), and the Wake that runs next and succeeds never clears it. The replica is awake
    at the level the router last ordered (0, 0), yet reports SleepState.error "sleep(level=1): ..."
    for good, and ready_for_work() returns False on that stale error: the work the router sent on
    seeing (0, 0) is silently not started (the router only finds out from the next listing, up to
    HELD_EVERY_S later, and sends it elsewhere). Right: a move's error is the error of the move
    last ordered; a superseded move that fails leaves no error once the later move succeeded, and
    work sent to the awake engine starts."""
    eng = SleepSaysAwake()
    moves = EngineMoves(eng, ClusterConfig(engine=EngineConfig(model="models/none")), "a")
    work = Work("s", 1, [1, 2], SamplingSpec())
    answers = [Orders(control=[Sleep(1), Wake(None, 0)]), Orders(start=[work])]

    async def pull(report):
        if not answers:
            loop.stop()
            return Orders()
        return answers.pop(0)

    loop = loop_over(eng, moves, pull)
    asyncio.run(asyncio.wait_for(loop.run(), 5))
    assert eng.calls == [("sleep", 1), ("wake",)]
    assert (moves.sleep_level, moves.sleep_goal) == (0, 0)
    assert moves.sleep_error is None, moves.sleep_error
    assert eng.started == [work]


# ---- a broken engine takes work -------------------------------------------------------------------
class BrokenAfterAbort(MixingEngine, Idle):
    def __init__(self):
        MixingEngine.__init__(self)
        Idle.__init__(self)


def test_a_replica_whose_weights_a_stopped_push_left_a_mix_runs_no_work():
    """A streamed push stopped halfway (its trainer aborted it, or died: push_watch) after its first
    bucket went in, on a replica with nothing to reload the weights it held from (dummy weights, or
    a push of the same dead trainer whose objects are gone): `_load_weights` sets `broken` (the
    weights are a mix) and leaves weights_version at the version held before. The router went back
    to exactly that version (FleetWeights.abort), so the replica's next report says it holds the
    current weights and it gets work; ready_for_work() returns True whenever no move is under way,
    broken or not, so the work runs on the mixed weights, labelled as the old version, until Serve's
    health check replaces the replica (and its hand-back then carries those tokens on elsewhere).
    The WeightsState it reports says nothing of `broken`. Right: a replica whose weights are unknown
    starts no work (and its report keeps the router from counting it as holding a version)."""
    eng = BrokenAfterAbort()
    moves = EngineMoves(eng, ClusterConfig(engine=EngineConfig(model="models/none")), "a")
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=1)
    objects, _ = pushed(2.0)

    def report(number):
        weights, sleep = moves.states()
        return Report("a", "i1", progress=[], stats=EngineStats(), model=MODEL, capacity=8, weights=weights,
                      sleep=sleep, number=number)

    async def go():
        loop = loop_over(eng, moves, None)
        core.on_report(report(1), 0.0)
        assert core.update_weights(PUSH, None, objects[:2], total=len(objects)) == 1
        orders = core.on_report(report(2), 0.1)
        assert [type(c) for c in orders.control] == [LoadWeights]
        eng.took.clear()
        await loop.apply(orders, [])
        await asyncio.wait_for(eng.took.wait(), 5)  # the first bucket went in
        core.abort_push(PUSH, "the trainer's process died")
        orders = core.on_report(report(3), 0.2)
        assert [type(c) for c in orders.control] == [StopPush]
        await loop.apply(orders, [])
        await asyncio.wait_for(moves.loading[1], 5)
        assert isinstance(moves.broken, WeightsLoadBroken)  # the engine's weights are a mix
        core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=2), 0, 0)], 0.3)
        orders = core.on_report(report(4), 0.4)
        await loop.apply(orders, [])
        return orders

    orders = asyncio.run(go())
    assert orders.start, "the router gave the broken replica no work (then only the replica side is left)"
    assert eng.started == [], f"work started on a mix of weights: {eng.started}"


# ---- the timeline ---------------------------------------------------------------------------------
class OneRunning(Idle):
    def drain(self) -> list:
        return [SeqProgress("s0", 1, [1, 2, 3])]

    def held(self) -> list:
        return [("s0", 1)]


class NoMoves:
    weights_version = 0
    broken = None
    digest = None

    def digest_delivered(self, answer):
        pass

    def states(self):
        from rollout_cluster.protocol import SleepState, WeightsState
        return WeightsState(), SleepState()


def test_a_pull_lines_time_is_when_the_pull_started(tmp_path):
    """timeline.py says each pull's line tells "when it started, what it carried, how long each part
    took", and its only time is `t`. PullLoop._record writes the line after the pace, so `t` is when
    the step ended: a pull's time, its router call and its pace later (up to report_interval_s plus
    the router's hold, 1 s and more when idle). The summary (experiments/router-overhead/
    timeline_summary.py) puts each pull's tokens into the window of `t`, and lining a replica's pulls
    up with anything else is off by a whole step. Right: `t` is when the step began (its first
    mark), or the line says which moment it is."""
    timeline = Timeline(str(tmp_path / "replica-a.jsonl"))

    async def slow_router(report):
        await asyncio.sleep(0.15)
        return Orders(report_interval_s=0.3)

    async def go():
        loop = loop_over(OneRunning(), NoMoves(), slow_router, RouterConfig(report_interval_s=0.3), timeline)
        await asyncio.sleep(0.05)
        await loop.step()

    asyncio.run(go())
    timeline.close()
    (line,) = [json.loads(x) for x in (tmp_path / "replica-a.jsonl").read_text().splitlines()]
    assert line["pull_ms"] >= 140 and line["pace_ms"] >= 100
    assert line["t"] < 0.1, f"t={line['t']}: the step began at about 0.05 s"


def test_a_failed_pull_is_a_line_of_the_timeline_too(tmp_path):
    """timeline.py: "one line per pull of the loop". A pull that fails (the router restarting, or a
    call never answered and given up after router.replica_timeout_s, 60 s by default) returns from
    PullLoop.step before _record, so it writes nothing: the very pulls where a replica's time went
    (a minute in a hung router call) leave a gap with no line in the diagnostic meant to show where
    time goes beside the engine's steps. Right: every pull writes its line, a failed one marked so
    (with its pull_ms)."""
    timeline = Timeline(str(tmp_path / "replica-a.jsonl"))
    calls = []

    async def router(report):
        calls.append(report)
        await asyncio.sleep(0.05)
        if len(calls) == 1:
            raise RuntimeError("Deployment 'Router' is unavailable")
        return Orders()

    async def go():
        loop = loop_over(OneRunning(), NoMoves(), router, RouterConfig(report_interval_s=0.05), timeline)
        await loop.step()  # fails (and waits RETRY_S)
        await loop.step()

    asyncio.run(go())
    timeline.close()
    lines = [json.loads(x) for x in (tmp_path / "replica-a.jsonl").read_text().splitlines()]
    assert len(calls) == 2
    assert len([x for x in lines if x["kind"] == "pull"]) == 2, lines


def test_a_broken_replica_says_goodbye_at_its_next_pull_and_its_work_goes_elsewhere():
    """The same mix as above: at its next step the pull loop gives up what the engine holds, says
    goodbye as a dead engine's replica does (the router counts a death and requeues its work at once,
    not after router.replica_timeout_s), and ends; check_health then has Serve replace it."""
    eng = BrokenAfterAbort()
    moves = EngineMoves(eng, ClusterConfig(engine=EngineConfig(model="models/none")), "a")
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=1)
    objects, _ = pushed(2.0)
    clock = {"t": 0.0}

    async def pull(report):
        clock["t"] += 0.1
        return core.on_report(report, clock["t"])

    async def go():
        loop = loop_over(eng, moves, pull)
        await loop.step()  # joins
        assert core.update_weights(PUSH, None, objects[:2], total=len(objects)) == 1
        eng.took.clear()
        await loop.step()  # the order of the push
        await asyncio.wait_for(eng.took.wait(), 5)
        core.abort_push(PUSH, "the trainer's process died")
        await loop.step()  # the StopPush
        await asyncio.wait_for(moves.loading[1], 5)
        assert isinstance(moves.broken, WeightsLoadBroken)
        bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=2), 0, 0)], clock["t"])
        return loop, await loop.step(), bid

    loop, alive, bid = asyncio.run(go())
    assert alive is False and eng.started == []
    assert "restart needed" in str(loop.error) and "mix of old and new" in str(loop.error)
    assert "a" not in core.fleet.replicas  # gone at once, counted a death
    assert core.counters.replica_deaths == 1
    assert len(core.seqs) == 1
    assert not any(s.replica for s in core.seqs.values()), "the batch's sequence waits for another replica"
