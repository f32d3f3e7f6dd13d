"""DeviceStaging: a pushed bucket's bytes from host memory to the worker's GPU through two reused
page-locked buffers, before the model's loaders see them.

A bucket read where it lies in Ray's object store (store_views.py) is pageable, file-backed
memory; vLLM's loaders copying each tensor from it to the GPU ran at about 6 GB/s on an H100 (a 7B
model's 15.2 GB in 2.6-2.8 s), which made the replica's load the whole of a streamed push. Through
a ring of two page-locked buffers, the CPU copying a chunk into one while the GPU reads the other,
the same bytes took 0.58 s (26-28 GB/s; experiments/weights-colocated/h2d_bench.py, results/h100-h2d).
The bucket then lies on the GPU as one uint8 tensor; its tensors are views of it, which the
loaders copy on the device. Page-locking the store itself would be faster still (54 GB/s) but
pins every page of the store's mapping; the ring pins only its own 2 x `chunk_bytes`.

The CPU's copy into the ring runs on torch's intra-op threads, which the ring sets to `threads`
(by default the process's CPUs, at most 8: `copy_threads`) for each bucket's copy and puts back
after. A streamed push runs the trainer's `ray.put`s on the same host at the same time: with
torch's 16 threads the ring ran at 17 GB/s and doubled the puts' time; with 8, 25-31 GB/s, and a
7B model's staged push went from 1.60-1.65 s to 1.17-1.27 s on one H100 host, side by side
(experiments/weights-colocated/results/h100-ring-threads). The ring's own Python threads, each
copying a slice, ran slower there (21-23 GB/s).

Without CUDA (`device` "cpu") the ring is a plain chunked copy: the same offsets, for the tests.
"""
from __future__ import annotations

import os
from typing import Optional

from .bucket_files import tensor_nbytes

CHUNK_BYTES = 64 << 20  # each ring buffer (two are kept per worker)
# "0": the loaders read the host bytes themselves (vLLM's own copies); "alternate": every other
# load of a worker staged (a benchmark's side-by-side: experiments/weights-colocated)
ENV = "ROLLOUT_DEVICE_STAGING"
THREADS_ENV = "ROLLOUT_STAGING_THREADS"  # torch's threads for the ring's copies, where the default is not wanted
MAX_THREADS = 8  # the default's ceiling: alone, 16 copied no faster than 8 on an H100's host


def copy_threads(env: Optional[str] = None, cpus: Optional[int] = None) -> int:
    """How many of torch's threads copy into the ring: ROLLOUT_STAGING_THREADS if set (digits, at
    least 1; more than the CPUs this process may run on counts as that many), else those CPUs, at
    most MAX_THREADS. A value that is no such number raises ValueError naming it."""
    env = os.environ.get(THREADS_ENV) if env is None else env
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    cpus = max(1, cpus)
    if env is None or not env.strip():
        return min(MAX_THREADS, cpus)
    text = env.strip()
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise ValueError(f"{THREADS_ENV}={env!r}: expected a whole number of threads >= 1")
    return min(int(text), cpus)


class DeviceStaging:
    def __init__(self, device, chunk_bytes: int = CHUNK_BYTES, threads: Optional[int] = None):
        import torch

        self.device = torch.device(device)  # where the buckets go
        self.chunk_bytes = chunk_bytes  # one ring buffer's size
        self.threads = copy_threads() if threads is None else threads  # torch's intra-op threads while a bucket is copied
        if not isinstance(self.threads, int) or isinstance(self.threads, bool) or self.threads < 1:
            raise ValueError(f"threads={threads!r}: expected a whole number >= 1")
        cuda = self.device.type == "cuda"
        self.ring = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        self.stream = torch.cuda.Stream(self.device) if cuda else None  # the host-to-device copies run here
        self.done = [torch.cuda.Event() if cuda else None for _ in range(2)]  # when the GPU has read each buffer
        self.copies = 0  # buckets moved so far

    def to_device(self, src) -> "torch.Tensor":
        """`src` (a flat uint8 host tensor) copied into a new uint8 tensor on the device; the
        current stream waits for the copies, so that whatever runs next on it reads the bytes.
        Torch's threads are `threads` meanwhile, in the calling thread (OpenMP's count is per
        thread; a thread that first uses torch's threads during the copy would keep this count:
        in vLLM's worker the loads run on the engine's one busy-loop thread)."""
        import torch

        before = torch.get_num_threads()
        if before == self.threads:
            return self._to_device(src)
        torch.set_num_threads(self.threads)
        try:
            return self._to_device(src)
        finally:
            torch.set_num_threads(before)

    def _to_device(self, src) -> "torch.Tensor":
        import torch

        nbytes = src.numel()
        out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        if self.stream is None:
            for off in range(0, nbytes, self.chunk_bytes):
                n = min(self.chunk_bytes, nbytes - off)
                self.ring[0][:n].copy_(src[off:off + n])
                out[off:off + n].copy_(self.ring[0][:n])
            self.copies += 1
            return out
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)  # (out was allocated on the current stream)
        used = [False, False]
        try:
            for i, off in enumerate(range(0, nbytes, self.chunk_bytes)):
                k, n = i % 2, min(self.chunk_bytes, nbytes - off)
                if used[k]:
                    self.done[k].synchronize()  # the GPU has read this buffer: it may be written again
                self.ring[k][:n].copy_(src[off:off + n])
                with torch.cuda.stream(self.stream):
                    out[off:off + n].copy_(self.ring[k][:n], non_blocking=True)
                    self.done[k].record(self.stream)
                used[k] = True
        finally:  # (also when a copy failed: the ring is free for the next bucket, from any call)
            for k in range(2):
                if used[k]:
                    self.done[k].synchronize()
        current.wait_stream(self.stream)
        self.copies += 1
        return out


ALIGN = 256  # a staged span starts at a multiple of this in its buffer (the views keep their alignment)


def bucket_span(header: dict) -> tuple[int, int]:
    """(first byte, end) of a packed bucket's tensors in the buffer its header's offsets index, the
    first byte rounded down to ALIGN. Tensors of no bytes have no place (their offset may be
    anything, 0 in a store region: store_views.py) and are left out."""
    sized = [(off, tensor_nbytes(dtype, shape))
             for dtype, shape, off in zip(header["dtypes"], header["shapes"], header["offsets"])]
    sized = [(off, n) for off, n in sized if n]
    if not sized:
        return 0, 0
    lo = min(off for off, _ in sized)
    return lo - lo % ALIGN, max(off + n for off, n in sized)


def rebased(header: dict, start: int) -> dict:
    """The header with its offsets counted from `start` (its tensors moved to a buffer of their own);
    a tensor of no bytes at 0."""
    offsets = [off - start if tensor_nbytes(dtype, shape) else 0
               for dtype, shape, off in zip(header["dtypes"], header["shapes"], header["offsets"])]
    return {**header, "offsets": offsets}


def wanted(device, direct: bool, env: Optional[str], world_size: int = 1) -> bool:
    """Whether a worker on `device` stages its host buckets on the device: a CUDA worker loading
    through vLLM's loaders (not direct_load.py, which is vLLM-CPU's), the engine's only worker,
    unless ROLLOUT_DEVICE_STAGING=0. (A tensor- or pipeline-parallel engine's workers each get every
    bucket: staging would copy all of it to every GPU, where vLLM's loaders copy each worker's
    shard only. Not measured yet: they load as before.)"""
    return getattr(device, "type", None) == "cuda" and not direct and env != "0" and world_size == 1


def room_for(nbytes: int, device, margin: int = 512 << 20) -> bool:
    """Whether the device has `nbytes` and `margin` more free, counting what torch's allocator holds
    unused: staging must not take the memory vLLM's loaders need next."""
    import torch

    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + cached >= nbytes + margin
