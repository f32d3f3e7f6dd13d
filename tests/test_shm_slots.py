"""The replica's /dev/shm slots (engines/shm_slots.py) and load_into's use of them, against a
stand-in engine whose collective_rpc runs TensorLoader's own rc_tensors_load / rc_tensors_end
(the model's load is a recorder). The real engine: tests/e2e/test_load_tensors.py."""
import asyncio
import glob
import os

import pytest
import torch

from rollout_cluster.engines import shm_slots, weight_loader
from rollout_cluster.engines.weight_loader import load_into
from rollout_cluster.engines.worker_loader import TensorLoader


class Recorder:
    """Stands in for DirectLoad: keeps a copy of every tensor loaded."""

    def __init__(self):
        self.got = {}

    def load(self, weights):
        for n, t in weights:
            self.got[n] = t.clone()
        return {n for n, _ in weights}

    def finish(self):
        pass


class Worker(TensorLoader):
    def __init__(self):
        self.rec = Recorder()
        self.model_runner = None

    def rc_tensors_begin(self):
        self._rc_expected, self._rc_loaded, self._rc_direct = set(), set(), self.rec
        self.vllm_config = None


class Engine:
    def __init__(self):
        self.worker = Worker()
        self.calls = []

    async def collective_rpc(self, method, args=()):
        import vllm.config

        self.calls.append(method)
        orig = vllm.config.set_current_vllm_config
        vllm.config.set_current_vllm_config = lambda cfg: _Null()
        try:
            return [getattr(self.worker, method)(*args)]
        finally:
            vllm.config.set_current_vllm_config = orig


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def buckets(seed: float, sizes=((1000, 3), (4000,), (7, 7))):
    return [[(f"t{i}-{j}", torch.full(s, seed + i + j / 10)) for j, s in enumerate([shape])]
            for i, shape in enumerate(sizes)]


def slot_files():
    return glob.glob(f"/dev/shm/rollout-slot-{os.getpid()}-*")


def test_slots_are_reused_from_one_load_to_the_next_and_leave_no_file_behind():
    eng = Engine()
    for seed in (1.0, 2.0, 3.0):
        n = asyncio.run(load_into(eng, buckets(seed), None))
        assert n == 3
        for b in buckets(seed):
            for name, t in b:
                assert torch.equal(eng.worker.rec.got[name], t), name
        assert not slot_files()  # unlinked once the worker mapped them
        slots = weight_loader._SLOTS[eng]
        ids = sorted(slots.ids())
        assert len(ids) == 2 and not slots.used  # one loading, one being written
        assert sorted(eng.worker._rc_slots) == ids  # the worker keeps exactly those mapped
        if seed == 1.0:
            first = ids
        assert ids == first


def test_a_bucket_larger_than_every_slot_gets_a_new_one_and_the_pool_stays_small():
    eng = Engine()
    asyncio.run(load_into(eng, buckets(1.0), None))
    big = [[("big", torch.ones(300_000))]]
    asyncio.run(load_into(eng, big, None))
    assert torch.equal(eng.worker.rec.got["big"], torch.ones(300_000))
    slots = weight_loader._SLOTS[eng]
    assert len(slots.free) <= shm_slots.MAX_FREE
    assert max(s.nbytes for s in slots.free) >= 1_200_000
    assert sorted(eng.worker._rc_slots) == sorted(slots.ids())
    assert not slot_files()


def test_a_shm_that_cannot_take_the_slot_falls_back_to_bytes(monkeypatch):
    def full(fd, off, n):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    eng = Engine()
    assert asyncio.run(load_into(eng, buckets(5.0), None)) == 3
    assert torch.equal(eng.worker.rec.got["t1-0"], torch.full((4000,), 6.0))
    assert not slot_files() and not weight_loader._SLOTS[eng].ids()
    assert not getattr(eng.worker, "_rc_slots", {})


def test_a_failed_load_drops_its_slot():
    eng = Engine()
    asyncio.run(load_into(eng, buckets(1.0), None))

    def broken(weights):
        raise RuntimeError("worker failed")

    eng.worker.rec.load = broken
    with pytest.raises(Exception, match="worker failed"):
        asyncio.run(load_into(eng, buckets(2.0), None))
    slots = weight_loader._SLOTS[eng]
    assert not slots.used and len(slots.free) <= 1  # the slot the failure was in is gone
    assert not slot_files()


def test_a_slot_whose_file_is_gone_is_refused_not_loaded_as_zeros(tmp_path):
    """Regression: a worker that had lost a slot's mapping called torch.from_file on the unlinked
    path, which made a new file of zeros, and the load went through with zeros."""
    import pytest

    from rollout_cluster.engines.worker_loader import TensorLoader

    gone = str(tmp_path / "rollout-slot-gone")
    loader = TensorLoader()
    header = {"names": ["w"], "dtypes": ["float32"], "shapes": [[4]], "offsets": [0], "nbytes": 16}
    with pytest.raises(FileNotFoundError, match="not mapped in this worker"):
        loader.rc_tensors_load(header, gone, slot=("s1", 16))
    assert not (tmp_path / "rollout-slot-gone").exists()


# Regression: a load whose first bucket failed in the worker put the slot it had written the next
# bucket into back in the pool, its /dev/shm file still there (the worker never mapped it, so
# nothing unlinked it); the failure breaks the engine, the replica restarts, and nothing ever
# closes the pool: the file stayed in /dev/shm, a bucket's size of memory, after the process.
def test_a_slot_the_worker_never_mapped_leaves_no_file_when_the_load_fails():
    eng = Engine()

    def broken(weights):
        raise RuntimeError("worker failed")

    eng.worker.rec.load = broken
    with pytest.raises(Exception, match="worker failed"):
        asyncio.run(load_into(eng, buckets(1.0), None))
    assert not slot_files()  # the process may end now (a broken engine restarts): nothing left behind
    slots = weight_loader._SLOTS[eng]
    assert not slots.used and all(s.shared for s in slots.free)


def test_the_pool_stays_whole_while_staging_threads_take_and_the_loop_gives(tmp_path):
    """take() runs in staging threads while give() runs on the event loop (and two takes overlap
    when a bucket falls back to a slot while the next is staged): under one lock no slot is handed
    out twice, none lost, and the pool keeps its bound."""
    import random
    import sys
    import threading

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (thread switches as often as CPython allows: races show)
    try:
        slots = shm_slots.Slots(str(tmp_path))
        held, errors, lock = [], [], threading.Lock()

        def worker(seed):
            rng = random.Random(seed)
            try:
                for _ in range(300):
                    slot = slots.take(rng.choice((64, 128, 256, 512)))
                    slot.worker_has_it()
                    with lock:
                        assert slot not in held, "a slot handed out twice"
                        held.append(slot)
                    with lock:
                        held.remove(slot)
                    slots.give(slot, ok=rng.random() > 0.05)
            except Exception as e:  # noqa: BLE001 (the test reports it)
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors
    assert not slots.used and len(slots.free) <= shm_slots.MAX_FREE
    assert len({s.id for s in slots.free}) == len(slots.free) and all(s.buf is not None for s in slots.free)
    slots.close()
    assert os.listdir(tmp_path) == []
