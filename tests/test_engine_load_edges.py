"""Loading weights into an engine, at edges a review found: a weight two layers share (tied
embeddings) gets its own loader back after each load (the wrappers nested, and the 123rd load hit
RecursionError); a keep swap cancelled while writing a bucket leaves no file in /dev/shm; a load
by bytes or file leaves the engine's shm slots mapped for the next load; a safetensors header that
is no object, or whose offsets are no byte counts, is a CheckpointError naming the file."""
import asyncio
import json
import os
import struct
import threading
import time

import pytest
import torch

from rollout_cluster.engines.checkpoint import CheckpointError, check_checkpoint
from test_shm_slots import Engine, buckets, slot_files


# --- direct_load.DirectLoad: a weight shared by two layers (tied embeddings) -------------------------

def _tied_model():
    from torch import nn
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.model_executor.model_loader.reload.meta import to_meta_tensor
    from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo

    class QuantMethod:
        def __init__(self):
            self.calls = 0

        def process_weights_after_loading(self, layer):
            self.calls += 1

    def loader(param, loaded_weight):
        param.data.copy_(loaded_weight)

    class Emb(nn.Module):
        def __init__(self, w):
            super().__init__()
            self.weight = w
            self.quant_method = QuantMethod()

    class Model(nn.Module):
        """embed_tokens and lm_head sharing one Parameter, as vLLM's tie_weights does
        (ParallelLMHead.tie_weights: layer.weight = embed_tokens.weight)."""

        def __init__(self):
            super().__init__()
            w = nn.Parameter(torch.zeros(4, 3), requires_grad=False)
            w.weight_loader = loader
            self.embed_tokens = Emb(w)
            self.lm_head = Emb(w)

        def load_weights(self, weights):
            params = dict(self.named_parameters())
            for n, t in weights:
                params[n].weight_loader(params[n], t)
            return {n for n, _ in weights}

    model = Model()
    for layer in (model.embed_tokens, model.lm_head):
        LAYERWISE_INFO[layer] = LayerReloadingInfo(restore_metadata=({"weight": to_meta_tensor(layer.weight)}, {}),
                                                   restore_device=torch.device("cpu"))
    return model, loader


def test_direct_load_puts_back_the_loader_of_a_tied_weight():
    """DirectLoad wraps the shared tensor's weight_loader once per layer (the second wrap wraps the
    first) and finish() puts the saved loaders back in the order it wrapped them, so the tensor is
    left with the first wrapper. Each later load nests one more stale wrapper: the embedding is
    processed once more per load, and after ~120 pushes the load dies with RecursionError."""
    from rollout_cluster.engines.direct_load import DirectLoad

    model, loader = _tied_model()
    pool: list = []
    per_load = []
    for i in range(3):
        before = model.embed_tokens.quant_method.calls
        load = DirectLoad(model, pool)
        load.load([("embed_tokens.weight", torch.full((4, 3), float(i + 1)))])
        load.finish()
        per_load.append(model.embed_tokens.quant_method.calls - before)
        assert torch.equal(model.embed_tokens.weight, torch.full((4, 3), float(i + 1)))
    assert model.embed_tokens.weight.weight_loader is loader, "the tied weight keeps a DirectLoad wrapper after finish"
    assert per_load == [1, 1, 1], f"embedding processed {per_load} times per load"


def test_many_loads_of_a_tied_model_do_not_exhaust_the_stack():
    from rollout_cluster.engines.direct_load import DirectLoad

    model, _ = _tied_model()
    pool: list = []
    for i in range(300):  # a few hundred weight pushes is a short RL run
        load = DirectLoad(model, pool)
        load.load([("embed_tokens.weight", torch.full((4, 3), float(i)))])
        load.finish()


# --- weight_keep.swap_into: cancelled while a bucket's /dev/shm file is being written ----------------

def test_a_keep_swap_cancelled_while_writing_a_bucket_leaves_no_file(monkeypatch, tmp_path):
    """swap_into writes each bucket with asyncio.to_thread(write_bucket, ...) outside its try/finally:
    cancelled meanwhile (the replica stopping), the thread still creates the file and nobody
    unlinks it: up to a bucket (256 MiB) left in /dev/shm per cancelled swap. load_into guards the
    same case (_stage_in_thread's done callback)."""
    from rollout_cluster.engines import bucket_files, weight_keep

    real = bucket_files.write_bucket
    started, release, written = threading.Event(), threading.Event(), threading.Event()

    def slow_write(bucket, directory=None):
        started.set()
        release.wait(10)
        try:
            return real(bucket, str(tmp_path))
        finally:
            written.set()

    monkeypatch.setattr(weight_keep, "write_bucket", slow_write)

    class Eng:
        async def collective_rpc(self, method, args=()):
            return [None]

    async def go():
        task = asyncio.ensure_future(weight_keep.swap_into(Eng(), [[("w", torch.ones(1000))]], None))
        deadline = time.monotonic() + 10
        while not started.is_set():
            assert time.monotonic() < deadline and not task.done(), task.done() and task.exception()
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        release.set()
        deadline = time.monotonic() + 10
        while not written.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # (a done callback that unlinks it runs on this loop)

    asyncio.run(go())
    assert os.listdir(tmp_path) == [], "a cancelled keep swap left its bucket's file behind"


# --- weight_loader: a load by another transport unmaps the pool's slots ------------------------------

def test_a_load_by_bytes_or_file_does_not_break_the_next_shm_load():
    """_end passes keep_slots=[] when the load used no slots (transport "file"/"bytes"), so the worker
    drops its mappings of the replica's pooled slots, whose files are unlinked already. The next
    shm load reuses a pooled slot and the worker refuses it: WeightsLoadBroken (the engine left
    with a mix). experiments/weights-in-place/bench.py alternates shm and bytes on one engine."""
    from rollout_cluster.engines.weight_loader import load_into

    eng = Engine()
    try:
        assert asyncio.run(load_into(eng, buckets(1.0), None)) == 3
        assert asyncio.run(load_into(eng, buckets(2.0), None, transport="bytes")) == 3
        assert asyncio.run(load_into(eng, buckets(3.0), None)) == 3
        assert torch.equal(eng.worker.rec.got["t0-0"], torch.full((1000, 3), 3.0))
    finally:
        from rollout_cluster.engines import weight_loader

        slots = weight_loader._SLOTS.pop(eng, None)
        if slots is not None:
            slots.close()
    assert slot_files() == []


# --- checkpoint: a .safetensors header that is JSON but not an object -------------------------------

@pytest.mark.parametrize("header", [
    b"[]",                                                                               # not an object
    json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, "8"]}}).encode(),  # offsets not ints
    b"null",
])
def test_a_safetensors_file_with_a_malformed_header_is_a_checkpoint_error(tmp_path, header):
    """_safetensors_short catches OSError/ValueError around json.loads, then calls header.items()
    and adds data_offsets to ints unguarded: AttributeError/TypeError escape check_checkpoint
    (the router's and each engine's check, and write_manifest) instead of the documented
    CheckpointError naming the file."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    with pytest.raises(CheckpointError, match="model.safetensors"):
        check_checkpoint(str(tmp_path), require_manifest=False)
