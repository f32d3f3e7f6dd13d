"""Weights orders that race a wake. A StopPush that reaches a level-2 sleeper while its engine is
still waking (vLLM's wake_up takes real time: it maps the memory back) ends the wake's reload of
the aborted push at once, as architecture.md promises, not after bucket_stream.STALL_S (60 s) of
waiting for objects that never come: the wake builds its BucketStream once the engine is awake,
after the stop, so the replica remembers the pushes stopped (EngineMoves.stopped_reasons) and a
stream of one is born stopped. A LoadWeights of a push that comes after its StopPush fails at once
the same way. On the router's side, a Wake still waiting when the weights change names the new
ones (FleetControl._rename_waiting_wakes)."""
import asyncio

from rollout_cluster.protocol import LoadWeights, NoteWeights, Sleep, StopPush, Wake
from rollout_cluster.transfer import bucket_stream
from rollout_cluster.transfer.push import PUSH_SCHEME

from test_push_abort import MixingEngine, moves_with, pushed

OTHER = f"{PUSH_SCHEME}s2"


class SlowWaker(MixingEngine):
    """Level 2 drops the weights; waking takes a while (as vLLM's wake_up does)."""

    asleep = False

    async def sleep(self, level):
        self.weights, self.asleep = {}, True

    async def wake(self):
        await asyncio.sleep(0.3)
        self.asleep = False

    async def sleeping(self):
        return self.asleep


def test_a_stop_taken_while_the_engine_wakes_ends_the_reload_of_the_aborted_push_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(bucket_stream, "STALL_S", 6.0)  # (60 s in production; the test waits 3 s at most)
    eng = SlowWaker()
    moves = moves_with(eng)
    objects, _ = pushed(2.0)

    async def go():
        moves.apply(LoadWeights(str(tmp_path), 1))
        await moves.loading[1]
        moves.apply(Sleep(2))
        await moves.sleep_task
        moves.apply(NoteWeights(OTHER, 2, objects[:2]))  # the push streamed to the sleeping fleet
        moves.apply(Wake(OTHER, 2, objects[:2]))  # wake() while the push still streams
        await asyncio.sleep(0.1)  # the engine is still waking when the trainer aborts the push
        moves.apply(StopPush(OTHER, "the trainer's push failed"))
        await asyncio.wait_for(asyncio.shield(moves.sleep_task), 3)  # at once, not after STALL_S

    asyncio.run(go())
    assert moves.broken is None and moves.sleep_level == 0
    assert (moves.weights_version, moves.weights_path) == (1, str(tmp_path))  # the weights it held, reloaded


def test_a_load_of_a_push_ordered_after_its_stop_fails_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(bucket_stream, "STALL_S", 6.0)
    eng = SlowWaker()
    moves = moves_with(eng)
    objects, _ = pushed(2.0)

    async def go():
        moves.apply(LoadWeights(str(tmp_path), 1))
        await moves.loading[1]
        moves.apply(StopPush(OTHER, "the trainer's push failed"))  # (its order's reply was lost, say)
        moves.apply(LoadWeights(OTHER, 2, objects[:2]))
        await asyncio.wait_for(asyncio.shield(moves.loading[1]), 3)

    asyncio.run(go())
    assert (moves.weights_version, moves.weights_path) == (1, str(tmp_path))
    assert moves.weights_error and "the trainer's push failed" in moves.weights_error, moves.weights_error


# ---- the router's side: an update between wake() and a replica's pull of its Wake ----------------
def test_a_wake_still_waiting_when_the_weights_change_names_the_new_weights():
    """A level-2 sleeper reloads what its Wake names. A Wake queued by wake() and not yet pulled
    when update_weights points the fleet at new weights (allowed: the fleet's level is 0 already,
    and nothing loads) still names the old version: the replica reloads the old checkpoint (which
    the trainer may have deleted by then: its reload fails and the replica is restarted), then
    loads the new one: two loads where architecture.md promises one."""
    from rollout_cluster.protocol import Wake as WakeOrder

    from test_fleet_sleep import core_with, pull, sleeps

    core = core_with(("a", "b"))
    core.update_weights("/ck/1")
    for rid in ("a", "b"):
        pull(core, rid, 0.1)
        pull(core, rid, 0.2, version=1, path="/ck/1")
    core.sleep_fleet(2)
    for rid in ("a", "b"):
        pull(core, rid, 0.3, version=1, path="/ck/1")
        pull(core, rid, 0.4, version=1, path="/ck/1", level=2)
    core.wake_fleet()
    assert sleeps(pull(core, "a", 0.5, version=1, path="/ck/1", level=2)) == [WakeOrder("/ck/1", 1, None)]
    assert core.update_weights("/ck/2") == 2  # b has not pulled its Wake yet
    wake_b = sleeps(pull(core, "b", 0.6, version=1, path="/ck/1", level=2))
    assert wake_b == [WakeOrder("/ck/2", 2, None)], wake_b
