"""What a load of named tensors must fit, checked before the engine is touched: the served
checkpoint's tensor names and shapes (from its safetensors headers), and a check that refuses,
naming the tensor, what does not fit them. No vllm here: the replica runs these."""
from __future__ import annotations

import json
import os
import warnings


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
        with warnings.catch_warnings():  # a read-only array (Ray's object store hands those out zero-copy)
            warnings.simplefilter("ignore", UserWarning)
            return torch.as_tensor(t)
    except Exception as e:
        raise TypeError(f"tensor {name!r}: {type(t).__name__} is not a tensor or an array") from e
