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

Without CUDA (`device` "cpu") the ring is a plain chunked copy: the same offsets, for the tests.
"""
from __future__ import annotations

from typing import Optional

CHUNK_BYTES = 64 << 20  # each ring buffer (two are kept per worker)
# "0": the loaders read the host bytes themselves (vLLM's own copies); "alternate": every other
# load of a worker staged (a benchmark's side-by-side: experiments/weights-colocated)
ENV = "ROLLOUT_DEVICE_STAGING"


class DeviceStaging:
    def __init__(self, device, chunk_bytes: int = CHUNK_BYTES):
        import torch

        self.device = torch.device(device)  # where the buckets go
        self.chunk_bytes = chunk_bytes  # one ring buffer's size
        cuda = self.device.type == "cuda"
        self.ring = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        self.stream = torch.cuda.Stream(self.device) if cuda else None  # the host-to-device copies run here
        self.done = [torch.cuda.Event() if cuda else None for _ in range(2)]  # when the GPU has read each buffer
        self.copies = 0  # buckets moved so far

    def to_device(self, src) -> "torch.Tensor":
        """`src` (a flat uint8 host tensor) copied into a new uint8 tensor on the device; the
        current stream waits for the copies, so that whatever runs next on it reads the bytes."""
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
        for i, off in enumerate(range(0, nbytes, self.chunk_bytes)):
            k, n = i % 2, min(self.chunk_bytes, nbytes - off)
            if used[k]:
                self.done[k].synchronize()  # the GPU has read this buffer: it may be written again
            self.ring[k][:n].copy_(src[off:off + n])
            with torch.cuda.stream(self.stream):
                out[off:off + n].copy_(self.ring[k][:n], non_blocking=True)
                self.done[k].record(self.stream)
            used[k] = True
        current.wait_stream(self.stream)
        out.record_stream(self.stream)  # (freed only once the copies into it are done)
        for k in range(2):  # the ring is free for the next bucket (which may come from another call)
            if used[k]:
                self.done[k].synchronize()
        self.copies += 1
        return out


def bucket_span(header: dict) -> tuple[int, int]:
    """(first byte, end) of a packed bucket's tensors in the buffer its header's offsets index."""
    import math

    ends = [off + math.prod(shape) * _itemsize(dtype)
            for dtype, shape, off in zip(header["dtypes"], header["shapes"], header["offsets"])]
    if not ends:
        return 0, 0
    return min(header["offsets"]), max(ends)


def rebased(header: dict, start: int) -> dict:
    """The header with its offsets counted from `start` (its tensors moved to a buffer of their own)."""
    return {**header, "offsets": [off - start for off in header["offsets"]]}


def _itemsize(dtype: str) -> int:
    import torch

    return getattr(torch, dtype).itemsize


def wanted(device, direct: bool, env: Optional[str]) -> bool:
    """Whether a worker on `device` stages its host buckets on the device: a CUDA worker loading
    through vLLM's loaders (not direct_load.py, which is vLLM-CPU's), unless ROLLOUT_DEVICE_STAGING=0."""
    return getattr(device, "type", None) == "cuda" and not direct and env != "0"
