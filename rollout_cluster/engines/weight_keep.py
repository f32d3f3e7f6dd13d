"""Weights swapped under running sequences (update_weights / push_weights running="keep"), as
PipelineRL does: the new tensors go in between two engine steps, and the running requests go on
with the KV cache the old weights built.

- `SwapLoader`: the worker extension (TensorLoader's methods and these). `rc_swap_stage` copies
  one bucket into the worker's own memory while the engine keeps stepping on the old weights;
  `rc_swap_apply` loads every staged bucket through vLLM's layerwise reload in ONE collective_rpc,
  which vLLM's EngineCore runs between two steps, and returns how many tokens each running
  request had sampled at that moment: the token where its weights changed.
- `swap_into(engine, buckets, spec, fence)`: the replica's side. Checks every bucket against the
  served checkpoint, stages them all, then applies: a refusal or a failure while staging leaves
  the old weights whole. Returns (tensors, {request id: tokens sampled before the swap}). While
  the swap is applied the running requests report nothing (the fence); if it fails inside vLLM
  (the weights a mix of old and new) they keep only the tokens they had before and are handed
  back, so that no token sampled on broken weights is kept.
- `checkpoint_buckets(path)`: a checkpoint's tensors as buckets (update_weights with "keep").
The swap costs one more copy of the weights in the worker's memory until it is applied.
"""
from __future__ import annotations

import asyncio
import os

from ..transfer.buckets import is_manifest
from ..transfer.ipc import is_ipc
from .weight_checks import BucketCheck, check_ahead
from .weight_digest import DigestWorker
from .bucket_files import map_shm, write_bucket
from .worker_loader import TensorLoader

EXTENSION = f"{__name__}.SwapLoader"  # the engine arg worker_extension_cls


class SwapLoader(TensorLoader, DigestWorker):
    """TensorLoader (in-place loads between batches) plus the staged swap for running="keep", and
    rc_weights_digest (weight_digest.py)."""

    def rc_swap_stage(self, header: dict, path: str) -> int:
        """Copy one packed bucket from its /dev/shm file into this worker's memory (the replica
        deletes the file after the call). Returns the number of buckets staged."""
        staged = getattr(self, "_rc_staged", None)
        if staged is None:
            staged = self._rc_staged = []
        staged.append((header, map_shm(path, header["nbytes"]).clone()))
        return len(staged)

    def rc_swap_drop(self) -> None:
        self._rc_staged = []

    def rc_swap_apply(self) -> dict:
        """Load every staged bucket, in one call: between two engine steps. Returns {"missing":
        parameters that got no tensor, "sampled": {vLLM request id: output tokens sampled so far}}."""
        staged, self._rc_staged = getattr(self, "_rc_staged", None) or [], []
        self.rc_tensors_begin()
        try:
            for header, buf in staged:
                self.rc_tensors_load(header, None, buf)
        finally:  # the replica's shm slots stay mapped: its next load between batches uses them
            missing = self.rc_tensors_end(keep_slots=list(getattr(self, "_rc_slots", {})))
        requests = getattr(self.model_runner, "requests", {})
        return {"missing": missing, "sampled": {rid: len(state.output_token_ids) for rid, state in requests.items()}}


def external_id(internal: str) -> str:
    """vLLM's request id without the "-<8 hex>" suffix its input processor adds."""
    head, sep, tail = internal.rpartition("-")
    return head if sep and len(tail) == 8 else internal


async def swap_into(engine, buckets, spec: dict | None, fence=None, handed: dict | None = None) -> dict:
    """Stage `buckets` (a list, iterator or async iterator) in the running AsyncLLM `engine`
    (worker_extension_cls=EXTENSION), then swap them in between two steps. Returns (tensors,
    {request id (ours, without vLLM's suffix): output tokens sampled before the swap}). Raises before the swap
    (old weights whole) on a refused or failed bucket; WeightsLoadBroken if vLLM fails during it.
    `fence` (VllmSeqs): closed just before the swap, so that the running requests report nothing
    sampled after it began; cut if the swap broke the weights (none of those tokens is kept). The
    caller opens it once the swap's marks are recorded. `handed` (optional): as load_into's, each
    bucket a "file"."""
    import asyncio
    from contextlib import aclosing

    from .base import WeightsLoadBroken
    from .weight_loader import WAYS, _each

    handed = {} if handed is None else handed
    handed.clear()
    handed.update(dict.fromkeys(WAYS, 0))
    check = BucketCheck(spec)
    try:
        async with aclosing(_each(buckets)) as source:  # stopped early, the source stops its fetch ahead
            async for bucket in source:
                if is_manifest(bucket):  # a push's manifest: refused before a bucket is staged
                    check_ahead(bucket, spec)
                    continue
                if is_ipc(bucket):
                    raise ValueError("running='keep' cannot take a push by CUDA IPC (the swap stages copies while "
                                     "the engine runs on): push with running='finish' or transport='object_store'")
                check.bucket(bucket)
                header, path = await _write_in_thread(bucket)
                try:
                    await engine.collective_rpc("rc_swap_stage", args=(header, path))
                    handed["file"] += 1
                finally:
                    os.unlink(path)
        check.finish()
    except BaseException:
        await engine.collective_rpc("rc_swap_drop")
        raise
    if fence is not None:
        fence.close_fence()
    try:
        per_worker = await engine.collective_rpc("rc_swap_apply")
        missing = sorted({n for r in per_worker for n in (r.get("missing") or ())})
        if missing:
            raise WeightsLoadBroken(f"{len(missing)} of the model's parameters got no tensor, e.g. {missing[:3]}: "
                                    "its weights are now a mix of old and new")
    except BaseException as e:  # (cancelled too: nobody learns whether the weights went in whole)
        if fence is not None:
            await asyncio.shield(fence.cut_fence())
        if isinstance(e, Exception) and not isinstance(e, WeightsLoadBroken):
            raise WeightsLoadBroken(f"vLLM failed swapping the weights in, which are now unknown: {e}") from e
        raise
    return len(check.seen), {external_id(rid): n for rid, n in (per_worker[0].get("sampled") or {}).items()}


def checkpoint_buckets(path: str, bucket_bytes: int = 256 << 20):
    """The safetensors checkpoint at `path` as buckets of (name, tensor), read by mmap."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{path!r}: no .safetensors file (running='keep' swaps safetensors checkpoints)")
    bucket, size = [], 0
    for f in files:
        with safe_open(os.path.join(path, f), framework="pt") as st:
            for name in st.keys():
                t = st.get_tensor(name)
                if bucket and size + t.numel() * t.element_size() > bucket_bytes:
                    yield bucket
                    bucket, size = [], 0
                bucket.append((name, t))
                size += t.numel() * t.element_size()
    if bucket:
        yield bucket


async def _write_in_thread(bucket) -> tuple:
    """write_bucket in a thread; a swap cancelled meanwhile deletes the file the thread still
    makes (else up to a bucket of RAM stayed in /dev/shm)."""
    job = asyncio.ensure_future(asyncio.to_thread(write_bucket, bucket))
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        job.add_done_callback(lambda j: j.cancelled() or j.exception() or _unlink(j.result()[1]))
        raise


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
