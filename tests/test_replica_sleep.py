"""A replica's side of sleep mode (serve/engine_moves.py, serve/pull_loop.py), without Ray: an
order starts a move in the background, a resent order is ignored, the engine's own word decides
the level reported, level 2 needs a checkpoint to reload and reloads the one the wake order names.
The real cluster: tests/e2e/test_sleep_mode.py."""
import asyncio

from rollout_cluster.config import ClusterConfig, EngineConfig
from rollout_cluster.protocol import LoadWeights, NoteWeights, Sleep, Wake
from rollout_cluster.serve.engine_moves import EngineMoves
from rollout_cluster.serve.pull_loop import PullLoop


class FakeEngine:
    def __init__(self, lies: bool = False):
        self.calls, self.asleep, self.lies = [], 0, lies

    async def sleep(self, level):
        self.calls.append(("sleep", level))
        await asyncio.sleep(0.01)
        self.asleep = 0 if self.lies else level

    async def wake(self):
        self.calls.append(("wake",))
        self.asleep = 0

    async def sleeping(self):
        return bool(self.asleep)

    async def load_weights(self, path, keep_as=None):
        self.calls.append(("load", path))


def replica(engine, model="models/none", load_format="auto", weights_path="") -> EngineMoves:
    r = EngineMoves(engine, ClusterConfig(engine=EngineConfig(model=model, load_format=load_format)), "a")
    r.weights_path = weights_path
    return r


def run(r, *orders):
    async def go():
        for order in orders:
            r.apply(order)
            assert r.sleep_goal == (order.level if isinstance(order, Sleep) else 0)  # set before the next pull
        await r.sleep_task

    asyncio.run(go())
    r.sleep_task = None  # done, and its loop is closed


def test_sleep_and_wake_move_in_order_and_a_resent_order_is_ignored():
    eng = FakeEngine()
    r = replica(eng)
    run(r, Sleep(1), Sleep(1))
    assert r.sleep_level == 1 and r.sleep_error is None and eng.calls == [("sleep", 1)]
    run(r, Wake(None, 0))
    assert r.sleep_level == 0 and eng.calls == [("sleep", 1), ("wake",)]  # level 1: no reload


def test_an_engine_that_does_not_sleep_is_an_error_not_a_level():
    r = replica(FakeEngine(lies=True))
    run(r, Sleep(1))
    assert r.sleep_level == 0 and "the engine says it is awake" in r.sleep_error


def test_level_two_needs_a_checkpoint_to_reload(tmp_path):
    r = replica(FakeEngine(), model="Qwen/Qwen2.5-7B-Instruct")  # a hub id: nothing local
    run(r, Sleep(2))
    assert r.sleep_level == 0 and r.engine.calls == []
    assert "sleep(level=2)" in r.sleep_error and "no local checkpoint" in r.sleep_error
    dummy = replica(FakeEngine(), model=str(tmp_path), load_format="dummy")
    run(dummy, Sleep(2))
    assert "load_format 'dummy'" in dummy.sleep_error


def test_a_deep_wake_reloads_the_weights_the_order_names(tmp_path):
    eng = FakeEngine()
    r = replica(eng, model=str(tmp_path))
    run(r, Sleep(2), Wake("/ckpt/step3", 3))
    assert eng.calls == [("sleep", 2), ("wake",), ("load", "/ckpt/step3")]
    assert (r.sleep_level, r.weights_version, r.weights_path) == (0, 3, "/ckpt/step3")
    # with no update since start, the config's own checkpoint, and still version 0
    eng2 = FakeEngine()
    r2 = replica(eng2, model=str(tmp_path))
    run(r2, Sleep(2), Wake(None, 0))
    assert eng2.calls[-1] == ("load", str(tmp_path)) and (r2.weights_version, r2.weights_path) == (0, "")


class FailingEngine(FakeEngine):
    def __init__(self, fail_sleep=None, fail_wake=1):
        super().__init__()
        self.fail_sleep, self.wakes_failing = fail_sleep, fail_wake

    async def sleep(self, level):
        if self.fail_sleep is not None:
            raise self.fail_sleep
        await super().sleep(level)

    async def wake(self):
        if self.wakes_failing:
            self.wakes_failing -= 1
            raise RuntimeError("CUDA error: out of memory")
        await super().wake()


def test_a_failed_wake_is_tried_again_at_the_next_wake_order():
    eng = FailingEngine()
    r = replica(eng)
    run(r, Sleep(1), Wake(None, 0))
    assert r.sleep_level == 1 and "out of memory" in r.sleep_error and r.broken is None
    run(r, Wake(None, 0))  # the same goal again: it failed, so it runs
    assert r.sleep_level == 0 and r.sleep_error is None


def test_vllm_failing_to_sleep_leaves_the_engine_untrusted_but_a_refusal_does_not():
    from rollout_cluster.engines.base import SleepRefused

    r = replica(FailingEngine(fail_sleep=AssertionError("freed_bytes >= 0")))
    run(r, Sleep(1))
    assert r.sleep_level == 0 and "freed_bytes" in r.sleep_error and "failed going to sleep" in str(r.broken)
    refused = replica(FailingEngine(fail_sleep=SleepRefused("engine.enable_sleep_mode is false")))
    run(refused, Sleep(1))
    assert "enable_sleep_mode" in refused.sleep_error and refused.broken is None


def test_a_deep_wake_whose_checkpoint_is_gone_has_no_weights_and_asks_for_a_restart(tmp_path):
    class Missing(FakeEngine):
        async def load_weights(self, path, keep_as=None):
            raise FileNotFoundError(f"no such checkpoint directory: {path}")

    ckpt = tmp_path / "step3"
    ckpt.mkdir()
    r = replica(Missing(), weights_path=str(ckpt))
    run(r, Sleep(2))
    assert r.sleep_level == 2
    ckpt.rmdir()  # the trainer rotated it away while the engine slept
    run(r, Wake(str(ckpt), 3))
    assert "no such checkpoint" in r.sleep_error and "no weights after a level-2 sleep" in str(r.broken)
    assert replica(FakeEngine(), weights_path=str(ckpt)).reload_source() is None  # refused at sleep


def test_a_note_of_an_update_made_while_asleep_is_held_until_a_load_brings_it(tmp_path):
    eng = FakeEngine()
    r = replica(eng, model=str(tmp_path))
    run(r, Sleep(2))

    async def notes():
        r.apply(NoteWeights("/ckpt/step1", 1))
        r.apply(NoteWeights("/ckpt/step2", 2))  # the router's later update replaces it
        # (a note numbered lower is kept too: only a restarted router sends one, its latest word;
        # tests/test_weights_renumbered_edges.py)

    asyncio.run(notes())
    assert r.noted == (2, "/ckpt/step2") and eng.calls == [("sleep", 2)]  # a note loads nothing
    run(r, Wake("/ckpt/step2", 2))
    assert (r.weights_version, r.weights_path, r.noted) == (2, "/ckpt/step2", (0, ""))


class SlowSleepEngine(FakeEngine):
    """Going to sleep takes a while: a wake (or a load) ordered meanwhile must wait for it."""
    capacity, dead, ended = 8, None, 0

    async def sleep(self, level):
        self.calls.append(("sleep", level))
        await asyncio.sleep(0.1)
        self.asleep = level
        self.calls.append(("asleep", level))

    def submit(self, work):
        self.calls.append(("start", work))

    def drain(self):
        return []

    def whole_final(self, p):
        return p

    def forget_finals(self, delivered):
        pass

    def held(self):
        return []

    def aborting(self):
        return []

    def stats(self):
        from rollout_cluster.protocol import EngineStats
        return EngineStats()


def test_a_load_ordered_while_the_engine_still_goes_to_sleep_waits_for_the_moves():
    eng = SlowSleepEngine()
    r = replica(eng)

    async def go():
        r.apply(Sleep(1))
        r.apply(Wake(None, 0))  # before the sleep ended
        r.apply(LoadWeights("/ckpt/2", 2))
        await asyncio.gather(r.sleep_task, r.loading[1])

    asyncio.run(go())
    assert eng.calls == [("sleep", 1), ("asleep", 1), ("wake",), ("load", "/ckpt/2")]
    assert (r.sleep_level, r.weights_version) == (0, 2)


def run_pull_loop(moves, answers: list) -> None:
    """Run a pull loop over `moves` against a router that answers each pull with the next of
    `answers`, then stops it."""
    from rollout_cluster.protocol import Orders

    async def pull(report):
        if not answers:
            loop.stop()
            return Orders()
        return answers.pop(0)

    loop = PullLoop(moves.engine, moves, pull, replica_id="a", incarnation="i1", model=None,
                    router_cfg=moves.cfg.router)
    asyncio.run(asyncio.wait_for(loop.run(), 5))


def sleep_wake_then_work(eng) -> tuple:
    """A replica over `eng` told to sleep and, before that ends, to wake; the next answer is work."""
    from rollout_cluster.protocol import Orders, SamplingSpec, Work

    r = replica(eng)
    work = Work("s", 1, [1, 2], SamplingSpec())
    run_pull_loop(r, [Orders(control=[Sleep(1), Wake(None, 0)]), Orders(start=[work])])
    return r, work


def test_work_sent_while_the_engine_still_moves_starts_once_it_is_awake():
    """A wake that came while the engine still went to sleep reports (0, 0), as an awake replica
    does, so the router may send work: the pull loop starts it after the moves."""
    eng = SlowSleepEngine()
    r, work = sleep_wake_then_work(eng)
    assert eng.calls == [("sleep", 1), ("asleep", 1), ("wake",), ("start", work)]


def test_work_sent_while_the_engine_moves_does_not_start_if_it_failed_to_wake():
    """The same, but the wake fails: the work is not started on an engine that sleeps (its next
    listing lacks it, so the router sends it elsewhere)."""
    class WakeFails(SlowSleepEngine):
        async def wake(self):
            self.calls.append(("wake",))
            raise RuntimeError("cannot wake")

    eng = WakeFails()
    r, work = sleep_wake_then_work(eng)
    assert eng.calls == [("sleep", 1), ("asleep", 1), ("wake",)] and "cannot wake" in r.sleep_error
