"""A weights load that stops early (a bucket fails or is refused, or the load is cancelled) stops
fetching the next bucket and leaves nothing behind: no fetch of a pushed bucket still running
(transfer/bucket_stream.fetched, which runs one bucket ahead), no /dev/shm slot taken and never given
back (engines/weight_loader.py, shm_slots.py).

Regression (h-route9, item 4): the loader left the bucket source open when it stopped, so the
fetch one ahead went on (holding the bucket's object and its memory) until the loop ended; a
cancelled load (not an Exception) also kept the slot it had staged the next bucket in, whose file
the worker never mapped stayed in /dev/shm after the process."""
import asyncio

import pytest
import torch

from rollout_cluster.engines import weight_loader
from rollout_cluster.engines.weight_keep import swap_into
from rollout_cluster.engines.weight_loader import load_into
from rollout_cluster.serve.engine_moves import fetched
from rollout_cluster.transfer.buckets import pack

from test_shm_slots import Engine, slot_files


def tensors(n: int = 4) -> list:
    return [(f"t{i}", torch.full((64,), float(i))) for i in range(n)]


class Ref:
    """A pushed bucket's object ref: `hang` never arrives (until the fetch is cancelled)."""

    def __init__(self, bucket, hang: bool = False):
        self.bucket, self.hang = bucket, hang
        self.started = self.cancelled = False

    def __await__(self):
        self.started = True
        try:
            yield from asyncio.sleep(3600 if self.hang else 0.01).__await__()  # (the next one starts meanwhile)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return self.bucket

    @property
    def running(self) -> bool:
        """Its fetch runs on (a fetch cancelled before it started never runs)."""
        return self.started and not self.cancelled


def refs(n_ok: int) -> tuple:
    """A push of n_ok buckets that arrive, then one that does not."""
    buckets = list(pack(tensors(n_ok + 1), bucket_bytes=256))  # one tensor a bucket
    assert len(buckets) == n_ok + 1
    return tuple(Ref(b) for b in buckets[:n_ok]) + (Ref(buckets[n_ok], hang=True),)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_load_that_fails_cancels_its_fetch_of_the_next_bucket():
    eng = Engine()

    def broken(weights):
        raise RuntimeError("worker failed")

    eng.worker.rec.load = broken
    pushed = refs(2)

    async def go():
        with pytest.raises(Exception, match="worker failed"):
            await load_into(eng, fetched(pushed), None)
        await settle()
        return pushed[2].running  # (asked before the loop ends: asyncio.run cancels what is left)

    assert not asyncio.run(go())  # fetched one ahead, and stopped with the load
    assert not weight_loader._SLOTS[eng].used and not slot_files()


def test_a_refused_bucket_cancels_the_fetch_of_the_next_one():
    eng = Engine()
    pushed = refs(2)
    spec = {"t0": (64,)}  # t1 is no weight of the served model: refused after t0 went in

    async def go():
        with pytest.raises(Exception, match="t1"):
            await load_into(eng, fetched(pushed), spec)
        await settle()
        return pushed[2].running  # (asked before the loop ends: asyncio.run cancels what is left)

    assert not asyncio.run(go())
    assert not weight_loader._SLOTS[eng].used and not slot_files()


def test_a_cancelled_load_gives_its_staged_slot_back_and_cancels_the_fetch():
    eng = Engine()
    release = None

    async def slow_rpc(method, args=()):
        if method == "rc_tensors_load" and release is not None and not release.is_set():
            await release.wait()  # the worker is slow with the first bucket
        return await Engine.collective_rpc(eng, method, args)

    eng.collective_rpc = slow_rpc
    pushed = refs(2)

    async def go():
        nonlocal release
        release = asyncio.Event()
        load = asyncio.ensure_future(load_into(eng, fetched(pushed), None))
        for _ in range(200):  # until bucket 1 is staged and bucket 2 asked for
            await asyncio.sleep(0.005)
            if pushed[2].started and weight_loader._SLOTS.get(eng) and len(weight_loader._SLOTS[eng].used) == 2:
                break
        assert pushed[2].started and len(weight_loader._SLOTS[eng].used) == 2
        load.cancel()  # the replica stops (shutdown) mid-load
        with pytest.raises(asyncio.CancelledError):
            await load
        await settle()
        return pushed[2].running

    assert not asyncio.run(go())
    assert not weight_loader._SLOTS[eng].used and not slot_files()  # no slot kept, no file left in /dev/shm


def test_a_refused_swap_cancels_the_fetch_of_the_next_bucket():
    class SwapEngine:
        async def collective_rpc(self, method, args=()):
            return [None]

    pushed = refs(2)

    async def go():
        with pytest.raises(ValueError, match="t1"):
            await swap_into(SwapEngine(), fetched(pushed), {"t0": (64,)})
        await settle()
        return pushed[2].running  # (asked before the loop ends: asyncio.run cancels what is left)

    assert not asyncio.run(go())


def test_a_load_cancelled_while_a_bucket_is_copied_gives_that_slot_back(monkeypatch):
    import time

    slots = weight_loader._slots_of(Engine())
    stage = weight_loader._stage

    def slow_stage(bucket, transport, slots=None):
        time.sleep(0.2)  # the copy into the slot, in its thread
        return stage(bucket, transport, slots)

    monkeypatch.setattr(weight_loader, "_stage", slow_stage)

    async def go():
        job = asyncio.ensure_future(weight_loader._stage_in_thread(tensors(1), "shm", slots))
        await asyncio.sleep(0.05)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        await asyncio.sleep(0.4)  # the thread is done: its slot came back

    asyncio.run(go())
    assert not slots.used and not slot_files()
