"""A bucket of named tensors as one flat run of bytes, for the hop from the replica's process to
vLLM's worker (engines/weight_loader.py): a header (names, dtypes, shapes, 64-byte aligned
offsets, size) and the bytes, in memory (`pack_bucket`), in a /dev/shm file (`write_bucket`) or a
reusable slot (shm_slots.py); `unpack_bucket` gives the (name, tensor) views back, and `map_shm`
maps a file without a copy.
"""
from __future__ import annotations

import math
import os
import uuid
import warnings

from .weight_checks import as_tensor

SHM_DIR = "/dev/shm"
ALIGN = 64  # bytes: where each tensor starts in a packed bucket


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

    buf = as_uint8(buf)
    out = []
    for name, dtype, shape, off in zip(header["names"], header["dtypes"], header["shapes"], header["offsets"]):
        dt = getattr(torch, dtype)
        n = tensor_nbytes(dtype, shape)
        out.append((name, buf[off:off + n].view(dt).view(shape)))
    return out


def tensor_nbytes(dtype: str, shape) -> int:
    """The bytes of a tensor of torch dtype name `dtype` and `shape`, as a bucket header gives them."""
    import torch

    return math.prod(shape) * getattr(torch, dtype).itemsize


def as_uint8(buf) -> "torch.Tensor":
    """`buf` as a flat uint8 tensor (a view: no copy): a tensor already, or anything with the
    buffer protocol (bytes, a numpy array from Ray's object store)."""
    import torch

    if isinstance(buf, torch.Tensor):
        return buf
    if not memoryview(buf).nbytes:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # read-only memory: the tensors are only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=torch.uint8)


def map_shm(path: str, nbytes: int):
    import torch

    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)  # mmap, no copy
