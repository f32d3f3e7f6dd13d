"""A load of checkpoint-format tensors straight into a running vLLM-CPU model: vLLM's layerwise
reload without its detours (experiments/weights-sync/README.md measured both).

vLLM's layerwise reload (model_executor/model_loader/reload) swaps every layer's tensors for meta
tensors, buffers each loader call (running the loader once more on meta under a copy counter),
materializes a complete layer in fresh memory, loads it, processes it and copies the result back
into the old storage. On vLLM-CPU the only processing an unquantized model has is in
`process_weights_after_loading` of UnquantizedLinearMethod and UnquantizedEmbeddingMethod:
`dispatch_cpu_unquantized_gemm` packs the weight into a new oneDNN handle (a linear layer's own
`weight` is then emptied; an embedding's is kept). So `DirectLoad`:
- loads every tensor whose live storage is intact (norms, embeddings, biases) in place, with the
  model's own loaders (`model.load_weights`: q/k/v and gate/up fusing and sharding as usual);
- gives a layer whose weight was emptied a weight in scratch memory reused from one load to the
  next (fresh memory costs a page fault per 4 KiB, which is slow in a VM), loads into it, and
  as soon as all of the layer's elements arrived runs the layer's own processing (a new oneDNN
  handle), after which the scratch is free for the next layer;
- processes at `finish` every layer that got elements but not all (padding), and every layer
  that shares a loaded parameter (tied embeddings: lm_head's handle is rebuilt too).
It takes only models whose every quant_method is one of those two classes, on the CPU platform
(`supported`); anything else goes through vLLM's layerwise reload.
"""
from __future__ import annotations

import inspect

SUPPORTED_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")


def supported(model) -> bool:
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or current_platform.is_zen_cpu():
        return False
    for layer in model.modules():
        qm = getattr(layer, "quant_method", None)
        if qm is not None and type(qm).__name__ not in SUPPORTED_METHODS:
            return False
        if qm is not None and layer not in LAYERWISE_INFO:  # no metadata to rebuild its weight from
            return False
    return True


class _Layer:
    """One processed layer's state during a load."""

    def __init__(self, name: str, layer, swap: dict, total: int):
        self.name = name  # the layer's module name
        self.layer = layer
        self.swap = swap  # {name: (live emptied Parameter, meta Parameter)} of tensors that need scratch
        self.total = total  # elements its loaders fill (vLLM's get_layer_size)
        self.loaded = 0  # elements loaded so far
        self.scratch: list = []  # scratch buffers it holds until it is processed
        self.materialized = False
        self.processed = False


class DirectLoad:
    """One load session: `load(weights)` per bucket, then `finish()`; returns names loaded."""

    def __init__(self, model, pool: list):
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        self.model, self.pool = model, pool  # pool: free uint8 scratch tensors, kept by the worker
        self.layers: dict = {}  # layer -> _Layer, for layers with a quant_method
        self.wrapped: list = []  # (tensor, its weight_loader before) to put back at finish
        for layer_name, layer in model.named_modules():
            if getattr(layer, "quant_method", None) is None:
                continue
            meta_params = LAYERWISE_INFO[layer].restore_metadata[0]
            swap = {}
            for name, meta in meta_params.items():
                live = layer._parameters.get(name)
                if live is not None and tuple(live.shape) == tuple(meta.shape):
                    continue
                meta = restore_layer_refs(meta, layer)  # its weight_loader bound to this layer again
                swap[name] = (live, meta)
                layer._parameters[name] = meta  # loaders see the checkpoint-shaped parameter
            total = sum(getattr(t, "weight_loader_numel", t.numel())
                        for n, t in list(layer._parameters.items()) + list(layer._buffers.items())
                        if t is not None and n not in SKIP_LOAD_TENSORS)
            state = _Layer(layer_name, layer, swap, total)
            self.layers[layer] = state
            for name, t in layer._parameters.items():
                if t is not None and name not in SKIP_LOAD_TENSORS:
                    self._wrap(state, name, t)

    def _wrap(self, state: _Layer, name: str, tensor) -> None:
        from vllm.model_executor.model_loader.reload.meta import get_numel_loaded
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader

        had = hasattr(tensor, "weight_loader")
        # a parameter vLLM's layerwise reload wrapped keeps its wrapper (on the metadata tensors):
        # the loader under it is the model's own
        original = unwrapped(tensor.weight_loader if had else default_weight_loader)
        signature = inspect.signature(original)
        load = self

        def counted_loader(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            if name in state.swap and not state.materialized:
                load._materialize(state)
            bound.arguments["param"] = getattr(state.layer, name)
            n, ret = get_numel_loaded(original, bound)
            state.loaded += n
            if state.loaded >= state.total:
                load._process(state)
            return ret

        self.wrapped.append((tensor, had, original))
        tensor.weight_loader = counted_loader

    def _materialize(self, state: _Layer) -> None:
        import math

        import torch

        for name, (_, meta) in state.swap.items():
            nbytes = math.prod(meta.shape) * meta.dtype.itemsize
            fits = [i for i, b in enumerate(self.pool) if b.numel() >= nbytes]
            if fits:
                buf = self.pool.pop(min(fits, key=lambda i: self.pool[i].numel()))
            else:
                buf = torch.empty(nbytes, dtype=torch.uint8)
            state.scratch.append(buf)
            t = buf[:nbytes].view(meta.dtype).view(meta.shape)
            t.__class__ = meta.__class__
            t.__dict__ = meta.__dict__.copy()
            t.requires_grad_(False)
            state.layer._parameters[name] = t
        state.materialized = True

    def _process(self, state: _Layer) -> None:
        layer = state.layer
        if hasattr(layer, "_already_called_process_weights_after_loading"):
            delattr(layer, "_already_called_process_weights_after_loading")
        layer.quant_method.process_weights_after_loading(layer)
        if hasattr(layer, "update_param_tp_status"):
            layer.update_param_tp_status()
        state.processed = True
        self.pool.extend(state.scratch)  # the layer's handle holds its own copy now
        state.scratch = []

    def load(self, weights) -> set:
        return set(self.model.load_weights(weights) or ())

    def finish(self) -> list:
        """Process what is left, put back the weights of layers that got nothing, unwrap loaders.
        Returns the layers that got no element (their old weights stay)."""
        from vllm.model_executor.model_loader.reload.sanitize import sanitize_layer_refs

        # in reverse: a tensor two layers share (tied embeddings) was wrapped twice, the second
        # wrapper around the first; forwards, the first wrapper stayed on it and nested at every load
        for tensor, had, original in reversed(self.wrapped):
            if had:
                tensor.weight_loader = original
            else:
                del tensor.weight_loader
        processed = {id(t) for s in self.layers.values() if s.processed and s.loaded
                     for t in s.layer._parameters.values() if t is not None}
        for state in self.layers.values():
            if state.processed:
                continue
            if state.loaded:  # elements left unloaded (padding): vLLM processes these too
                self._process(state)
                continue
            for name, (live, _) in state.swap.items():  # got nothing: the old weights stay
                state.layer._parameters[name] = live
            if any(id(t) in processed for t in state.layer._parameters.values() if t is not None):
                self._process(state)  # a tied weight was loaded through another layer
        for state in self.layers.values():  # the metadata holds no reference to its layer again
            for _, meta in state.swap.values():
                sanitize_layer_refs(meta, state.layer)
        return sorted(s.name for s in self.layers.values() if not s.loaded and s.total)


def unwrapped(loader):
    """The loader under vLLM's layerwise wrappers (layerwise.py's _get_original_loader)."""
    while getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    return loader
