"""The replica side (serve/replica.py, pull_loop.py, engine_moves.py) at two more edges, without
Ray: a shutdown's hand-back whose engine is slow to end a given-up sequence still says goodbye
with what it has, and a wake that comes while the engine still goes to sleep does not report the
replica awake (the router would give it work, and the pull loop would wait for the whole move
before it pulls again)."""
import asyncio
import logging
import types

from rollout_cluster.config import ClusterConfig, EngineConfig, PolicyConfig, RouterConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import EngineStats, ModelInfo, SamplingSpec, SeqProgress, SequenceRequest
from rollout_cluster.router.core import RouterCore
from rollout_cluster.serve import replica as replica_module
from rollout_cluster.serve.engine_moves import EngineMoves
from rollout_cluster.serve.pull_loop import PullLoop
from rollout_cluster.serve.replica import EngineReplica

COST = load_profile("h200-1.5b", max_num_seqs=8)
MODEL = ModelInfo(100, 64)


# ---- the shutdown's hand-back --------------------------------------------------------------------
class SlowAbortEngine:
    """Holds two sequences; a give-up ends the first at once (its partial drains) and the second
    never (vLLM's abort of it is slow, or lost)."""

    capacity, dead, ended = 8, None, 0

    def __init__(self):
        self.holding = [("s0", 0), ("s1", 0)]
        self.pending: list = []
        self.shut = False

    def held(self):
        return list(self.holding)

    def aborting(self):
        return []

    def drain(self):
        out, self.pending = self.pending, []
        return out

    def stats(self):
        return EngineStats()

    def whole_final(self, p):
        return p

    async def give_up(self, keys):
        if ("s0", 0) in self.holding:
            self.holding.remove(("s0", 0))
            self.pending.append(SeqProgress("s0", 0, [7, 8, 9], None, "abort", offset=0))

    async def shutdown(self):
        self.shut = True


class BareReplica(EngineReplica.func_or_class):
    def __del__(self):  # garbage collection: nothing to do (the test calls the real one itself)
        pass


def test_a_shutdown_whose_engine_is_slow_to_end_a_given_up_sequence_still_hands_back_what_it_has(monkeypatch, caplog):
    """replica.py `_hand_back` runs inside `wait_for(..., HAND_BACK_S)` (`__del__`), but it waits
    `give_up_all(HAND_BACK_S)` for the engine to end what it gave up: the whole budget, after the
    wait for the pull loop. One sequence whose abort does not end in time leaves no time for the
    goodbye, so nothing is handed back: neither that sequence's last deltas nor the partials of the
    sequences that did end (the router requeues them only after router.replica_timeout_s, from
    older tokens). leave_broken_engine splits its budget (HAND_BACK_S / 2 each) for this reason."""
    monkeypatch.setattr(replica_module, "HAND_BACK_S", 0.6)  # (10 s in production: the same shares)
    engine = SlowAbortEngine()
    got: list = []

    async def pull(report):
        got.append(report)
        return None

    r = object.__new__(BareReplica)
    r.cfg, r.engine, r.replica_id = ClusterConfig(), engine, "r0"
    r.link = types.SimpleNamespace(pull=pull)
    r.moves = EngineMoves(engine, r.cfg, "r0")
    r.pull_loop = PullLoop(engine, r.moves, pull, replica_id="r0", incarnation="i0", model=None,
                           router_cfg=r.cfg.router)
    r.pull_loop.unsent = [SeqProgress("s1", 0, [4, 5], None, None, offset=0)]  # made since the last report

    async def go():
        # the pull loop's last pull still in flight: it ends a moment after the stop
        r.task = asyncio.get_running_loop().create_task(asyncio.sleep(0.1))
        await EngineReplica.func_or_class.__del__(r)

    asyncio.run(go())
    assert engine.shut
    goodbyes = [rep for rep in got if rep.leaving]
    assert goodbyes, "no goodbye was sent: the wait for the engine took the whole hand-back budget"
    sent = {(p.seq_id, p.finish_reason) for p in goodbyes[-1].progress}
    assert sent == {("s0", "abort"), ("s1", None)}


# ---- a wake that comes while the engine still goes to sleep --------------------------------------
class SlowMovesEngine:
    """A sim-like engine whose level-2 sleep takes a moment and whose reload at wake lasts until
    the test releases it (a big checkpoint read from disk)."""

    capacity, dead, ended = 8, None, 0

    def __init__(self):
        self.asleep = 0
        self.started: list = []
        self.release = asyncio.Event()

    def drain(self):
        return []

    def held(self):
        return [(w.seq_id, w.attempt) for w in self.started]

    def aborting(self):
        return []

    def stats(self):
        return EngineStats()

    def whole_final(self, p):
        return p

    def forget_finals(self, delivered):
        pass

    def report_whole(self, keys):
        pass

    async def give_up(self, keys):
        pass

    def submit(self, work):
        self.started.append(work)

    async def sleep(self, level):
        await asyncio.sleep(0.2)
        self.asleep = level

    async def wake(self):
        self.asleep = 0

    async def sleeping(self):
        return bool(self.asleep)

    async def load_weights(self, path, keep_as=None):
        await self.release.wait()


def test_a_wake_taken_while_the_engine_still_goes_to_sleep_does_not_hold_up_the_pulls(tmp_path):
    """engine_moves.py `states()` reports SleepState(level=sleep_level, goal=sleep_goal): a Wake
    taken while the Sleep(2) move still runs sets the goal back to 0 and the level was never
    changed, so the replica reports (0, 0), an awake replica's state, while its engine is about to
    drop its weights and reload them. The router (FleetSleep.awake) then gives it work, and the
    pull loop's `ready_for_work()` waits for the sleep and the whole reload before it pulls again:
    no report for as long as the reload takes (past router.replica_timeout_s the router takes it
    for dead), against the rule that a move runs in the background while the replica keeps pulling."""
    engine = SlowMovesEngine()
    cfg = ClusterConfig(engine=EngineConfig(model=str(tmp_path)))  # a local checkpoint: level 2 may reload it
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=1)
    clock = {"t": 0.0}

    async def pull(report):
        clock["t"] += 0.05
        return core.on_report(report, clock["t"])

    async def go():
        moves = EngineMoves(engine, cfg, "a")
        loop = PullLoop(engine, moves, pull, replica_id="a", incarnation="i1", model=MODEL,
                        router_cfg=RouterConfig(), clock=lambda: clock["t"])
        await loop.step()  # joins
        core.sleep_fleet(2)
        await loop.step()  # takes Sleep(2): the engine goes to sleep (0.2 s)
        assert moves.sleep_task is not None and not moves.sleep_task.done()
        core.wake_fleet()
        await loop.step()  # takes the Wake while the sleep still runs
        core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=2), 0, 0)], clock["t"])
        try:
            await asyncio.wait_for(loop.step(), 1.0)  # must not wait for the sleep and the reload
            blocked = False
        except asyncio.TimeoutError:
            blocked = True
        engine.release.set()
        return blocked, core.sleep_status()

    blocked, status = asyncio.run(go())
    assert not blocked, (f"the pull loop waited for the replica's sleep and reload: the router took it for awake "
                         f"({status}) and sent work with the moves under way")
