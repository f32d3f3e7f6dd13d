"""Buckets read where they lie in Ray's object store (engines/store_views.py): the worker maps the
store's file and loads from it, no slot copy; where it cannot, the bucket goes through a slot.
The store here is what Ray's is on Linux: a /dev/shm file, unlinked, mapped shared; the worker
is TensorLoader's own code in this process (tests/test_shm_slots.py's stand-in engine). On the
cluster: tests/e2e/test_push_weights*.py (their pushes go this way where the worker can map)."""
import asyncio
import mmap
import os
import subprocess
import sys
import uuid

import numpy as np
import pytest
import torch

from rollout_cluster.engines import store_views, weight_loader
from rollout_cluster.engines.weight_loader import load_into
from test_shm_slots import Engine, slot_files

STORE_BYTES = 1 << 22


class Store:
    """A stand-in for Ray's object store: numpy arrays viewing one shared, unlinked /dev/shm file."""

    def __init__(self):
        path = f"/dev/shm/rollout-test-store-{uuid.uuid4().hex[:8]}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, STORE_BYTES)
            self.mm = mmap.mmap(fd, STORE_BYTES)
        finally:
            os.close(fd)
            os.unlink(path)
        self.mem = np.frombuffer(self.mm, dtype=np.uint8)
        self.used = 0

    def put(self, t: torch.Tensor) -> torch.Tensor:
        """`t`'s bytes in the store, as a tensor viewing them (what ray.get gives: no copy)."""
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
        self.used = -(-self.used // 64) * 64
        view = self.mem[self.used:self.used + raw.nbytes]
        view[:] = raw
        self.used += raw.nbytes
        return torch.from_numpy(view).view(t.dtype).reshape(t.shape)


def pushed(store: Store, seed: float) -> tuple:
    want = [[(f"t{i}", torch.full(shape, seed + i))] for i, shape in enumerate([(100, 30), (4000,), (7, 7)])]
    return want, [[(n, store.put(t)) for n, t in b] for b in want]


def loads_two_pushes(store: Store, eng) -> None:
    """Two pushes of other values into the engine, each tensor checked as the worker got it."""
    for seed in (1.0, 2.0):
        want, buckets = pushed(store, seed)
        assert asyncio.run(load_into(eng, buckets, None)) == 3
        for b in want:
            for name, t in b:
                assert torch.equal(eng.worker.rec.got[name], t), name


def test_buckets_in_the_store_are_loaded_from_it_without_a_slot_and_mapped_once():
    store, eng = Store(), Engine()
    loads_two_pushes(store, eng)
    assert eng.calls.count("rc_map_region") == 1  # one mapping of the store, kept from load to load
    assert "rc_tensors_load" in eng.calls
    assert not weight_loader._SLOTS[eng].ids() and not slot_files()  # no slot was made: nothing copied
    assert len(eng.worker._rc_regions) == 1


def test_a_bucket_outside_the_store_goes_through_a_slot():
    eng = Engine()
    buckets = [[("h", torch.full((500,), 3.0))]]  # heap memory (a private mapping): not the store's
    assert asyncio.run(load_into(eng, buckets, None)) == 1
    assert torch.equal(eng.worker.rec.got["h"], torch.full((500,), 3.0))
    assert "rc_map_region" not in eng.calls and weight_loader._SLOTS[eng].ids()


def test_a_worker_that_cannot_map_the_store_gets_every_bucket_through_slots(monkeypatch):
    def refused(region):
        raise PermissionError(1, "Operation not permitted", region["path"])

    monkeypatch.setattr(store_views, "open_region", refused)
    store, eng = Store(), Engine()
    loads_two_pushes(store, eng)
    assert eng.calls.count("rc_map_region") == 1  # asked once; the engine copies into slots for good
    assert not weight_loader._VIEWS[eng].usable and weight_loader._SLOTS[eng].ids()
    assert not getattr(eng.worker, "_rc_regions", {})


def test_a_mapping_is_looked_up_again_once_another_file_is_mapped_at_its_addresses():
    """The replica remembers where the store is mapped (no read of /proc/self/maps per bucket),
    but checks by the file's name that the same file is still there."""
    store = Store()
    views = store_views.StoreViews()
    first, _ = views.region([store.put(torch.ones(64)).view(torch.uint8)])
    start = next(iter(views.known)).start
    assert views.region([store.put(torch.ones(64)).view(torch.uint8)])[0] == first
    del store  # unmapped; another file mapped where it was
    import gc
    gc.collect()
    path = f"/dev/shm/rollout-test-store-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, STORE_BYTES)
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        MAP_FIXED_NOREPLACE = 0x100000
        addr = libc.mmap(start, STORE_BYTES, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | MAP_FIXED_NOREPLACE,
                         fd, 0)
        assert addr == start, "could not map the other file at the same addresses"
        t = torch.frombuffer((ctypes.c_uint8 * 64).from_address(start), dtype=torch.uint8)
        second, _ = views.region([t])
        assert second["ino"] == os.fstat(fd).st_ino != first["ino"]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        del t
        libc.munmap(start, STORE_BYTES)
    finally:
        os.close(fd)
        os.unlink(path)


def test_a_region_that_is_another_file_is_refused():
    store = Store()
    t = store.put(torch.ones(64))
    region, _ = store_views.StoreViews().region([t.view(torch.uint8)])
    with pytest.raises(OSError, match="not the object store's"):
        store_views.open_region({**region, "ino": region["ino"] + 1})


def test_the_layerwise_reload_keeps_copies_not_views_of_a_bucket_the_replica_let_go(monkeypatch):
    """A layer cut across buckets is buffered by vLLM's layerwise reload as views of the first
    bucket; once its load returned, the replica lets the object go and Ray may reuse its memory
    (here: overwritten with zeros right after each load)."""
    import vllm.config
    from test_slot_reuse import Engine as LayerwiseEngine, LayerwiseModel, Worker

    class Null:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Reusing(LayerwiseEngine):
        async def collective_rpc(self, method, args=()):
            out = await super().collective_rpc(method, args)
            if method == "rc_tensors_load":  # the object is freed and its memory reused
                header = args[0]
                for off, name in zip(header["offsets"], header["names"]):
                    store.mem[off:off + tensors[name].numel() * 4] = 0
            return out

    monkeypatch.setattr(vllm.config, "set_current_vllm_config", lambda cfg: Null())
    store = Store()
    g = torch.Generator().manual_seed(0)
    names = ["head.w"] + [f"l{i}.{p}" for i in range(3) for p in ("q", "k")] + ["tail.w"]
    tensors = {n: torch.randn(256, generator=g) for n in names}
    buckets = [[(n, store.put(tensors[n])) for n in names[i:i + 2]] for i in range(0, len(names), 2)]
    model = LayerwiseModel({"head": {"head.w"}, "tail": {"tail.w"},
                            **{f"l{i}": {f"l{i}.q", f"l{i}.k"} for i in range(3)}})
    engine = Reusing(Worker(model))
    assert asyncio.run(load_into(engine, buckets, None)) == len(names)
    assert weight_loader._VIEWS[engine].mapped  # it went through the region
    wrong = sorted(n for n in names if not torch.equal(model.weights[n], tensors[n]))
    assert not wrong, f"loaded other bytes than pushed: {wrong}"


CHILD = r"""
import mmap, os, sys
import numpy as np, torch
from rollout_cluster.engines.store_views import StoreViews, open_region
fd = int(sys.argv[1])
mm = mmap.mmap(fd, 1 << 20)
os.close(fd)
mem = np.frombuffer(mm, dtype=np.uint8)
flat = torch.from_numpy(mem[4096:8192])
found = StoreViews().region([flat])
assert found is not None, "no path to the store's file"
region, offsets = found
assert region["path"].startswith(f"/proc/{os.getppid()}/fd/"), region["path"]
buf = open_region(region)
assert torch.equal(buf[offsets[0]:offsets[0] + 4096], flat)
views = StoreViews()
views.region([flat])
assert views.known, "readlink of map_files needs no capability: the mapping is remembered"
print("ok")
"""


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/sbin/capsh"), reason="needs root and capsh")
def test_without_the_capability_for_map_files_the_parents_descriptor_is_used(tmp_path):
    """Docker's default capabilities have neither CAP_SYS_ADMIN nor CAP_CHECKPOINT_RESTORE, so the
    replica's own /proc/<pid>/map_files cannot be opened; Ray's raylet, the replica's parent,
    holds the store's file open: /proc/<parent>/fd/<n> opens it."""
    path = f"/dev/shm/rollout-test-store-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(path)
    os.posix_fallocate(fd, 0, 1 << 20)
    os.pwrite(fd, os.urandom(8192), 0)
    try:
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        (tmp_path / "child.py").write_text(CHILD)
        out = subprocess.run(["/usr/sbin/capsh", "--drop=cap_sys_admin,cap_checkpoint_restore", "--",
                              "-c", f"exec {sys.executable} {tmp_path / 'child.py'} {fd}"],
                             pass_fds=(fd,), env=env, capture_output=True, text=True, timeout=120)
    finally:
        os.close(fd)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]
