"""push_weights(transport="ipc") without a GPU: the checks of the trainer's side, the bucket's
format at the replica, the worker's refusal of a handle from another GPU, and the lease that
keeps a joiner from opening a released push (transfer/ipc.py)."""
import asyncio
import os
import pickle

import pytest
import torch

from rollout_cluster.client import fleet_ops
from rollout_cluster.engines.weight_checks import BucketCheck
from rollout_cluster.engines.weight_keep import swap_into
from rollout_cluster.engines.weight_loader import load_into
from rollout_cluster.transfer.buckets import bucket_bytes_of
from rollout_cluster.transfer.ipc import unpack_ipc as unpack
from rollout_cluster.transfer.ipc import IpcHold, check_transport, hold_lease, is_ipc, open_handles


def ipc_bucket(hold: IpcHold, names=("a", "b"), shapes=([2, 3], [4]), gpu="GPU-aaa", host=None) -> dict:
    """A bucket as IpcHold.buckets makes it, with fake rebuild args (no CUDA here): each tensor's
    args name its shape in slot 1 and the trainer's device in slot 6."""
    handles = [{gpu: ("T", shape, None, 0, "S", torch.bfloat16, 0)} for shape in shapes]
    return {"names": list(names), "dtypes": ["bfloat16"] * len(names), "shapes": [list(s) for s in shapes],
            "gpu_uuid": gpu, "ipc": pickle.dumps(handles), "nbytes": 28, "lease": hold.lease,
            "host": host or hold.host}


def fake_rebuild(*args):
    """rebuild_cuda_tensor's stand-in: a tensor of the shape in args[1], remembering args[6]."""
    t = torch.zeros(args[1], dtype=args[5])
    t.device_arg = args[6]
    return t


@pytest.fixture
def hold(tmp_path):
    h = IpcHold.start(str(tmp_path))
    yield h
    if os.path.exists(h.lease):
        h.release(1.0)


def test_a_transport_other_than_object_store_or_ipc_is_refused_naming_it():
    with pytest.raises(ValueError, match="transport='nccl'"):
        check_transport("nccl", "finish")
    with pytest.raises(ValueError, match="running='keep'"):
        check_transport("ipc", "keep")
    check_transport("object_store", "keep")
    check_transport("ipc", "recompute")
    # push_weights checks it before it asks anything of the fleet
    with pytest.raises(ValueError, match="transport='shm'"):
        fleet_ops.push_weights(None, [("a", torch.zeros(2))], None, 1 << 20, 5.0, "finish", "shm")


def test_ipc_refuses_a_cpu_tensor_naming_it_and_its_device(hold):
    with pytest.raises(ValueError, match=r"named_tensors\['w'\]: on device cpu"):
        list(hold.buckets([("w", torch.zeros(3))], 1 << 20))
    with pytest.raises(TypeError, match="expected a torch.Tensor"):  # the pair checks of object_store's pack
        list(hold.buckets([("w", [1.0])], 1 << 20))
    assert hold.tensors == []


class Sleeping:
    """A client whose fleet sleeps (fleet_ops reads status() only before it refuses)."""

    def status(self) -> dict:
        return {"sleep": {"level": 1}}


def test_an_ipc_push_to_a_sleeping_fleet_is_refused_before_any_tensor_is_sent():
    with pytest.raises(RuntimeError, match="sleeps \\(level 1\\); wake\\(\\) first"):
        fleet_ops.push_weights(Sleeping(), [("a", torch.zeros(2))], None, 1 << 20, 5.0, "finish", "ipc")


def test_an_ipc_bucket_unpacks_to_meta_tensors_the_bucket_check_checks(hold):
    raw = ipc_bucket(hold)
    assert bucket_bytes_of(raw) == 28
    b = unpack(raw)
    assert is_ipc(b) and [n for n, _ in b] == ["a", "b"]
    assert all(t.device.type == "meta" and t.dtype == torch.bfloat16 for _, t in b)
    assert b.header == {"names": ["a", "b"], "dtypes": ["bfloat16"] * 2, "shapes": [[2, 3], [4]], "nbytes": 28}
    BucketCheck({"a": (2, 3), "b": (4,)}).bucket(b)
    with pytest.raises(ValueError, match=r"tensor 'b': shape \(4,\), the served model's is \(5,\)"):
        BucketCheck({"a": (2, 3), "b": (5,)}).bucket(b)
    with pytest.raises(ValueError, match="unknown dtype 'bfloat99'"):
        unpack({**raw, "dtypes": ["bfloat99", "bfloat16"]})


def test_the_worker_refuses_a_handle_from_another_gpu_naming_both():
    header = {"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[2, 3]]}
    handles = pickle.dumps([{"GPU-trainer": ("T", [2, 3], None, 0, "S", torch.bfloat16, 3)}])
    with pytest.raises(ValueError, match="from GPU GPU-trainer, but this replica's engine runs on GPU GPU-other"):
        open_handles(header, handles, 0, "GPU-other", rebuild=fake_rebuild)
    # on the same GPU: rebuilt on this worker's device index, whatever the trainer's was
    [(name, t)] = open_handles(header, handles, 1, "GPU-trainer", rebuild=fake_rebuild)
    assert name == "a" and t.device_arg == 1 and t.shape == (2, 3)
    with pytest.raises(ValueError, match=r"tensor 'a': its handle opens a torch.bfloat16 \(2, 3\) tensor, the header "
                                         r"says bfloat16 \(3, 2\)"):
        open_handles({**header, "shapes": [[3, 2]]}, handles, 0, "GPU-trainer", rebuild=fake_rebuild)


def test_a_released_push_or_another_host_is_refused_before_the_worker_opens_a_handle(hold):
    b = unpack(ipc_bucket(hold))
    fd = hold_lease(b)
    assert not hold.release(0.2)  # a replica still loads: the trainer keeps its tensors
    os.close(fd)
    assert hold.release(1.0) and not os.path.exists(hold.lease)
    with pytest.raises(RuntimeError, match="released its tensors"):
        hold_lease(b)
    with pytest.raises(RuntimeError, match="from host 'trainer-host'"):
        hold_lease(unpack(ipc_bucket(hold, host="trainer-host")))


class Engine:
    """The AsyncLLM surface load_into uses, recording its calls (no vLLM here)."""

    def __init__(self, hold: IpcHold):
        self.hold, self.calls = hold, []

    async def collective_rpc(self, method, args=()):
        if method == "rc_tensors_load_ipc":  # the lease is held while the worker opens the handles
            assert not self.hold.release(0.05)
        self.calls.append((method, args))
        return [[]] if method == "rc_tensors_end" else [None]


async def _aiter(items):
    for x in items:
        yield x


def test_load_into_sends_the_handles_to_the_worker_and_lets_the_lease_go_after(hold):
    raw = ipc_bucket(hold)
    engine = Engine(hold)
    assert asyncio.run(load_into(engine, _aiter([unpack(raw)]), {"a": (2, 3), "b": (4,)})) == 2
    methods = [m for m, _ in engine.calls]
    assert methods == ["rc_tensors_begin", "rc_tensors_load_ipc", "rc_tensors_end"]
    header, handles = engine.calls[1][1]
    assert handles == raw["ipc"] and header["names"] == ["a", "b"]
    assert hold.release(1.0)  # the replica closed its lease


def test_a_refused_ipc_bucket_leaves_the_engine_untouched_and_keep_refuses_ipc(hold):
    engine = Engine(hold)
    with pytest.raises(ValueError, match="tensor 'b': shape"):
        asyncio.run(load_into(engine, _aiter([unpack(ipc_bucket(hold))]), {"a": (2, 3), "b": (9,)}))
    assert engine.calls == []

    async def swap():
        return await swap_into(engine, _aiter([unpack(ipc_bucket(hold))]), None)

    with pytest.raises(ValueError, match="running='keep' cannot take a push by CUDA IPC"):
        asyncio.run(swap())
    assert [m for m, _ in engine.calls] == ["rc_swap_drop"]


def test_a_release_that_timed_out_still_closes_the_lease_to_a_later_replica(hold):
    """Regression: release() that gave up waiting for a slow loader left the lease file open, so a
    replica that came later (a joiner, a level-2 wake) took the lease and opened handles to
    tensors the trainer was already changing again (push_weights had returned)."""
    b = unpack(ipc_bucket(hold))
    fd = hold_lease(b)
    assert not hold.release(0.1)  # the slow loader keeps the tensors alive (never freed)
    try:
        with pytest.raises(RuntimeError, match="released its tensors"):
            hold_lease(b)
    finally:
        os.close(fd)


def test_the_worker_waits_for_copies_out_of_the_trainers_memory_made_at_the_end_of_the_load(monkeypatch):
    """Regression: vLLM's layerwise reload keeps a layer's tensors until the layer is complete and
    processes what is left (attention layers, padded ones) in finalize_layerwise_reload, at
    rc_tensors_end. Only rc_tensors_load_ipc synchronized the GPU, so copies out of the trainer's
    memory queued at the end could still run once the replica let the lease go and the trainer
    changed its tensors."""
    import vllm.config

    from rollout_cluster.engines.worker_loader import TensorLoader
    from rollout_cluster.transfer import ipc

    events = []

    class Deferring:  # stands in for a reload that reads the tensors of an incomplete layer at the end
        def __init__(self):
            self.kept = []

        def load(self, weights):
            self.kept += weights
            return {n for n, _ in weights}

        def finish(self):
            events.extend(("read", n) for n, _ in self.kept)

    class Null:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    class Worker(TensorLoader):
        model_runner, vllm_config = None, None

    monkeypatch.setattr(vllm.config, "set_current_vllm_config", lambda cfg: Null())
    monkeypatch.setattr(ipc, "device_uuid", lambda index: "GPU-trainer")
    monkeypatch.setattr(ipc, "open_handles", lambda header, handles, index, gpu: [("a", torch.zeros(2))])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append(("sync", device)))
    w = Worker()
    w._rc_expected, w._rc_loaded, w._rc_direct = {"a"}, set(), Deferring()
    assert w.rc_tensors_load_ipc({"names": ["a"], "nbytes": 8}, b"") == 1
    assert w.rc_tensors_end([]) == []
    assert ("read", "a") in events and events[-1] == ("sync", 0)
