"""Tensors into buckets and back: the unit push_weights moves.

A bucket is a plain dict (Ray serializes its numpy arrays out of band, so a reader on the same
node maps them from the object store without a copy):
  names:  the tensors' names, in the trainer's order (its state_dict names);
  dtypes: torch dtype names ("bfloat16", "float32", ...);
  shapes: each tensor's shape;
  data:   one uint8 numpy array per tensor, its bytes (bfloat16 has no numpy type: bytes travel);
          a bucket pushed by CUDA IPC carries handles instead (ipc.py).
Buckets hold about `bucket_bytes` each (a tensor larger than that is a bucket of its own), so a
receiver loads one bucket while the next one travels, and no message holds a whole model. A push
sends one more object ahead of them, its manifest ({"manifest": [each bucket's names, dtypes and
shapes]}): a replica checks the whole push against the served model before its engine takes the
first bucket, since a refusal after that would leave a mix of two models.
"""
from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Iterable, Iterator

from ..protocol import is_int

DEFAULT_BUCKET_BYTES = 256 << 20


def check_bucket_bytes(bucket_bytes) -> None:
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes!r}: must be an integer >= 1")


def checked(named_tensors: Iterable, bucket_bytes: int) -> Iterator[tuple]:
    """The (name, tensor) pairs, each checked: a pair, a str name given once, a torch.Tensor."""
    import torch

    check_bucket_bytes(bucket_bytes)
    seen = set()
    for item in named_tensors:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(f"named_tensors: expected (name, tensor) pairs, got {type(item).__name__}")
        if not isinstance(item[0], str):
            raise TypeError(f"named_tensors: a name must be a str, got {item[0]!r} ({type(item[0]).__name__})")
        name, tensor = item
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"named_tensors[{name!r}]: expected a torch.Tensor, got {type(tensor).__name__}")
        if name in seen:
            raise ValueError(f"named_tensors[{name!r}]: given twice")
        seen.add(name)
        _packable(name, tensor)
        yield name, tensor


def _packable(name: str, tensor) -> None:
    """A tensor whose bytes can be pushed as they are: dense, with data, one process's whole tensor.
    Checked as each pair comes, so a streamed push (which plans every tensor before its order) fails
    before any replica is ordered, naming the tensor, not in the middle with a torch error."""
    import torch

    if _is_dtensor(tensor):  # torch.distributed.tensor: this rank's shard only
        raise TypeError(f"named_tensors[{name!r}]: a DTensor (sharded across ranks): push the whole tensor "
                        "(tensor.full_tensor(), called on every rank) from one rank")
    if tensor.is_meta:
        raise ValueError(f"named_tensors[{name!r}]: a meta tensor has no data (shape {list(tensor.shape)})")
    if tensor.layout != torch.strided or tensor.is_nested:
        what = "a nested tensor" if tensor.is_nested else f"layout {tensor.layout}"
        raise ValueError(f"named_tensors[{name!r}]: {what}: only dense (strided) tensors can be pushed; push "
                         "tensor.to_dense()")
    if _is_fake(tensor):
        raise TypeError(f"named_tensors[{name!r}]: a FakeTensor (torch.compile's tracing) has no data: push the "
                        "real tensor")


def _is_fake(tensor) -> bool:
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:  # (a torch without it has none)
        return False
    return isinstance(tensor, FakeTensor)


def _is_dtensor(tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # (a torch built without distributed has no DTensor)
        return False
    return isinstance(tensor, DTensor)


def pack(named_tensors: Iterable, bucket_bytes: int = DEFAULT_BUCKET_BYTES, staging=None) -> Iterator[dict]:
    """Buckets of (name, tensor) pairs, in order. Tensors are detached and copied to host memory
    once (a CPU tensor that is contiguous already is viewed, not copied). With `staging` (a
    staging.Staging) the copies go into its reused buffer, pinned for GPU tensors: each bucket's
    bytes are then good only until the next bucket is asked for (push puts each one first)."""
    group, size = [], 0
    for name, tensor in checked(named_tensors, bucket_bytes):
        n = tensor.numel() * tensor.element_size()
        if group and size + n > bucket_bytes:
            yield _packed(group, staging, bucket_bytes)
            group, size = [], 0
        group.append((name, tensor))
        size += n
    if group:
        yield _packed(group, staging, bucket_bytes)


def _packed(group: list, staging, reserve: int = 0) -> dict:
    """One bucket of the (name, tensor) pairs, their bytes in host memory (`reserve`: the push's
    bucket size, which the staging buffer holds once it grows)."""
    import torch

    from .staging import bucket_span, needs_copy

    bucket = _empty()
    # (a lazily conjugated or negated view's bytes are not its values: resolved first)
    group = [(name, t.resolve_conj().resolve_neg()) for name, t in group]
    copied = [t for _, t in group if needs_copy(t)] if staging is not None else []
    if copied:
        nbytes = bucket_span([t.numel() * t.element_size() for t in copied])
        # (the buffer grows once to a bucket of the push; never past what this bucket holds: a push
        # of a few small tensors with a huge bucket_bytes would reserve all of it)
        whole = sum(t.numel() * t.element_size() for _, t in group)
        staging.start(nbytes, cuda=any(t.is_cuda for t in copied), reserve=min(reserve, whole))
    try:
        for name, tensor in group:
            if copied and needs_copy(tensor):
                data = staging.take(tensor)
            else:
                t = tensor.detach().to("cpu").contiguous()
                data = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else _no_bytes()
            bucket["names"].append(name)
            bucket["dtypes"].append(str(tensor.dtype).removeprefix("torch."))
            bucket["shapes"].append(list(tensor.shape))
            bucket["data"].append(data)
    finally:  # (failed midway too: no copy still lands in the buffer the next bucket takes)
        if copied:
            staging.ready()
    return bucket


def plan(named_tensors: Iterable, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list:
    """The (name, tensor) pairs grouped into buckets as `pack` groups them, from their sizes
    alone (nothing copied): a push's manifest goes out before its first bucket is packed."""
    groups, size = [], 0
    for name, tensor in checked(named_tensors, bucket_bytes):
        n = tensor.numel() * tensor.element_size()
        if not groups or (groups[-1] and size + n > bucket_bytes):
            groups.append([])
            size = 0
        groups[-1].append((name, tensor))
        size += n
    return groups


def planned_header(group: list) -> dict:
    """A planned bucket's `header` (its names, dtypes and shapes), before it is packed."""
    return {"names": [n for n, _ in group], "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in group],
            "shapes": [list(t.shape) for _, t in group]}


def pack_group(group: list, staging=None, bucket_bytes: int = 0) -> dict:
    """One planned bucket packed (`pack`'s bucket of the same tensors; `bucket_bytes`: the size
    `plan` grouped them by)."""
    return _packed(group, staging, bucket_bytes)  # (plan checked every tensor)


def check_lists(header: dict, keys: tuple = ("names", "dtypes", "shapes")) -> None:
    """A header's per-tensor lists are lists of one length: a shorter one would drop tensors
    silently (zip), and the load would find them missing only once it began replacing weights."""
    lists = {k: header.get(k) for k in keys}
    bad = [k for k, v in lists.items() if not isinstance(v, (list, tuple))]
    if bad:
        raise ValueError(f"bucket header: {', '.join(bad)} must be a list, one entry per tensor")
    lengths = {k: len(v) for k, v in lists.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError("bucket header: its lists differ in length (" + ", ".join(f"{k} {n}" for k, n in lengths.items())
                         + "): one entry per tensor in each")


def unpack(bucket: dict) -> list:
    """The (name, tensor) pairs of a bucket; the tensors view the bucket's bytes (read only). (An
    IPC bucket has no bytes: ipc.unpack_ipc reads it.)"""
    import warnings

    import torch

    check_lists(bucket, ("names", "dtypes", "shapes", "data"))
    out = []
    for name, dtype, shape, data in zip(bucket["names"], bucket["dtypes"], bucket["shapes"], bucket["data"]):
        torch_dtype = getattr(torch, dtype, None)
        if not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
        expected = math.prod(shape) * torch_dtype.itemsize if all(is_int(d) and d >= 0 for d in shape) else -1
        if getattr(data, "nbytes", -1) != expected:  # (an empty one would load as uninitialised memory)
            raise ValueError(f"tensor {name!r}: {getattr(data, 'nbytes', '?')} bytes where its header says {dtype} "
                             f"{list(shape)} ({expected if expected >= 0 else 'no'} bytes)")
        with warnings.catch_warnings():  # arrays from Ray's object store are read only; loaders copy them
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.from_numpy(data)
        out.append((name, flat.view(torch_dtype).reshape(shape) if len(data) else torch.empty(shape, dtype=torch_dtype)))
    return out


def header(bucket: dict) -> dict:
    """A bucket's names, dtypes and shapes (no bytes): its entry in the push's manifest."""
    return {k: bucket[k] for k in ("names", "dtypes", "shapes")}


def manifest(headers: list) -> dict:
    """The object a push sends ahead of its buckets: each one's `header`, in order."""
    return {"manifest": headers}


@dataclass
class Manifest:
    """A push's manifest at the replica (the first object fetched): what every bucket holds."""

    headers: list  # one {"names", "dtypes", "shapes"} per bucket, in the buckets' order

    def meta_buckets(self) -> list:
        """Each bucket as (name, meta tensor) pairs, which weight_checks.BucketCheck checks as it
        checks the bucket itself (no memory: meta tensors)."""
        import torch

        out = []
        for header in self.headers:
            check_lists(header)
            bucket = []
            for name, dtype, shape in zip(header["names"], header["dtypes"], header["shapes"]):
                torch_dtype = getattr(torch, dtype, None)
                if not isinstance(torch_dtype, torch.dtype):
                    raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
                bucket.append((name, torch.empty(shape, dtype=torch_dtype, device="meta")))
            out.append(bucket)
        return out


def is_manifest(bucket) -> bool:
    return isinstance(bucket, Manifest)


def bucket_bytes_of(bucket: dict) -> int:
    if "ipc" in bucket:  # the tensors' bytes, which stay on the trainer's GPU
        return bucket["nbytes"]
    return sum(d.nbytes for d in bucket["data"])


def _empty() -> dict:
    return {"names": [], "dtypes": [], "shapes": [], "data": []}


def _no_bytes():
    import numpy as np

    return np.zeros(0, dtype=np.uint8)
