"""What the weight relay (relay.py) accepts from a trainer, checked before a byte is received:
the fields of its requests (each refusal names one and its value), the bounds on what one tensor
and one update may take, and how vLLM's packer cuts tensors into the chunks the trainer
broadcasts."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

DEFAULT_PACKED_BUFFER_BYTES = 1 << 30  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES
MAX_PACKED_BUFFER_BYTES = 4 << 30  # a packed chunk the relay allocates at once: 4x vLLM's default
# Bounds where the served model's names and shapes (a spec) are unknown, so that no announcement
# makes the relay allocate what a trainer chooses (with a spec, its shapes bound every tensor). The largest tensor of a 70B model
# (Llama 3's embedding, 128256 x 8192) is 4 GiB in float32, a 405B model's 7.8 GiB; 405B in
# bfloat16 is 810 GB.
MAX_TENSOR_BYTES = 8 << 30  # one tensor
MAX_UPDATE_BYTES = 1 << 40  # the tensors staged in one update


class RelayError(ValueError):
    """A request the relay refuses; the message names the field and the value."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class RelayTimeout(RuntimeError):
    """A relay step waited past its bound (an NCCL receive has none of its own): the relay gave
    its communicator up (WeightRelay.give_up) and the next init opens a new one."""

    def __init__(self, step: str, what: str, bound_s: float):
        super().__init__(f"{step} waited more than {bound_s:g} s for {what}: the relay gave its communicator "
                         "up (what it had staged is dropped); initialize the weight transfer again")
        self.step = step  # the relay's method that was stuck
        self.what = what  # what it waited for


@dataclass(frozen=True)
class Wire:
    """How vLLM's trainer sends (its init_info, kept until the group closes)."""
    packed: bool  # packed chunks (True: TRL >= 1.11 and vLLM's trainer engine default) or one tensor at a time
    buffer_bytes: int  # the packed chunk size both sides cut at


def torch_dtype(field: str, name):
    """torch.float32 from "float32" (vLLM's spelling) or "torch.float32" (TRL <= 1.10's)."""
    import torch

    dtype = getattr(torch, str(name).removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise RelayError(field, f"{name!r} is not a floating-point torch dtype")
    return dtype


def check_integer(field: str, value) -> None:
    """An integer where one is meant: JSON's true, 2.0 or "2" is none (true == 1 and 2.0 == 2 in Python)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise RelayError(field, f"{value!r}: must be an integer")


def check_bool(field: str, value) -> bool:
    """A JSON boolean where one is meant: the string "false" is truthy in Python."""
    if not isinstance(value, bool):
        raise RelayError(field, f"{value!r}: must be true or false")
    return value


def check_address(host, port, host_field: str = "host", port_field: str = "port") -> None:
    """The trainer's rendezvous address, refused naming the request's own fields."""
    if not isinstance(host, str) or not host:
        raise RelayError(host_field, f"{host!r}: must be a host name or address")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise RelayError(port_field, f"{port!r}: must be a TCP port")


def check_init_info(info) -> Wire:
    """vLLM's init_info for /init_weight_transfer_engine, checked before the relay joins the group
    (the trainer's rank 0 and the relay's rank 1): how the trainer will send."""
    if not isinstance(info, dict):
        raise RelayError("init_info", f"{str(info)[:80]!r}: must be an object")
    for key in ("master_address", "master_port", "rank_offset", "world_size"):
        if key not in info:
            raise RelayError(f"init_info.{key}", "missing (the relay joins by TCP rendezvous)")
    check_address(info["master_address"], info["master_port"], "init_info.master_address", "init_info.master_port")
    for key in ("rank_offset", "world_size"):
        check_integer(f"init_info.{key}", info[key])
    if info["world_size"] != 2 or info["rank_offset"] != 1:
        raise RelayError("init_info.world_size", f"{info['world_size']!r} with rank_offset "
                         f"{info['rank_offset']!r}: must be 2 and 1 (the trainer's rank 0 and the relay's "
                         "rank 1: /get_world_size answers 1)")
    size = info.get("packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_BYTES)
    if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_PACKED_BUFFER_BYTES:
        raise RelayError("init_info.packed_buffer_size_bytes",
                         f"{size!r}: must be an integer from 1 to {MAX_PACKED_BUFFER_BYTES}")
    # vLLM >= 0.28 carries `packed` here (its trainer's default: True); older ones in update_info
    return Wire(check_bool("init_info.packed", info.get("packed", True)), size)


def check_shape(shape, field: str) -> list:
    if not (isinstance(shape, (list, tuple)) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                      for d in shape)):
        raise RelayError(field, f"{shape!r}: must be a list of integers >= 0")
    return list(shape)


@dataclass(frozen=True)
class Bounds:
    """What a trainer may send the relay, checked from an announcement (no byte allocated): the
    served model's names and shapes where known (which bound the bytes: a weight of the model is
    taken whatever its size), else bytes bounded by the config's estimate and by fixed caps."""
    spec: Optional[dict]  # {name: shape} of the served model, or None (nothing to build it from)
    max_bytes: Optional[int] = None  # without a spec, the config's estimate: a tensor's and an update's cap
    max_tensor_bytes: int = MAX_TENSOR_BYTES  # without a spec, what one tensor may take at most
    max_update_bytes: int = MAX_UPDATE_BYTES  # without a spec, what one update's staged tensors may take at most

    def tensor(self, name, shape: list, dtype, name_field: str, shape_field: str) -> int:
        """One announced tensor's bytes; refused under `name_field` (a name the model lacks) or
        `shape_field` (unlike the model's shape, or too many bytes)."""
        if not isinstance(name, str) or not name:
            raise RelayError(name_field, f"{name!r}: must be a tensor name")
        if self.spec is not None:
            if name not in self.spec:
                raise RelayError(name_field, f"{name!r}: the served model has no such weight")
            if tuple(shape) != tuple(self.spec[name]):
                raise RelayError(shape_field, f"{list(shape)} for {name!r}: the served model's is "
                                              f"{list(self.spec[name])}")
        size = math.prod(shape) * dtype.itemsize
        for bound, why in self._caps():
            if bound is not None and size > bound:
                raise RelayError(shape_field, f"{list(shape)} of {dtype} for {name!r}: {size} bytes, more than the "
                                              f"bound of {bound} ({why})")
        return size

    def update(self, field: str, held: dict, sizes: dict) -> None:
        """An update holding `held` ({name: bytes}) and these `sizes` (replacing any of their names) fits."""
        total = sum(b for n, b in held.items() if n not in sizes) + sum(sizes.values())
        for bound, why in self._caps(update=True):
            if bound is not None and total > bound:
                raise RelayError(field, f"{list(sizes)[:3]}: this update would hold {total} bytes, more than "
                                        f"the bound of {bound} ({why})")

    def drain_bound(self, buffer_bytes: int) -> int:
        """The largest piece a refused announcement is received in: a packed chunk of the served
        model (the chunk size plus its largest tensor at 8 bytes an element)."""
        if self.spec:
            return buffer_bytes + 8 * max(math.prod(shape) for shape in self.spec.values())
        return buffer_bytes + (self.max_bytes or 0)

    def _caps(self, update: bool = False) -> tuple:
        if self.spec is not None:  # (its names and shapes bound every tensor, and an update holds each once)
            return ()
        return ((self.max_bytes, "the served model's: twice its size in float32"),
                (self.max_update_bytes, "any one update's") if update else (self.max_tensor_bytes, "any one tensor's"))


def packed_chunks(sizes: list, buffer_bytes: int) -> list:
    """The tensors' indices per packed chunk, as vLLM's packer and its NCCL consumer cut them: a
    chunk takes tensors until its size passes `buffer_bytes`."""
    chunks, chunk, total = [], [], 0
    for i, size in enumerate(sizes):
        chunk.append(i)
        total += size
        if total > buffer_bytes:
            chunks.append(chunk)
            chunk, total = [], 0
    if chunk:
        chunks.append(chunk)
    return chunks


def unpacked(part, shape: list, dtype):
    """One tensor's bytes in a packed chunk, as that tensor. vLLM's packer concatenates the
    tensors' bytes with no padding (packed_tensor.pack_tensors), so after an odd-sized tensor of a
    narrower dtype (a bfloat16 [3] before a float32) a piece starts where its dtype cannot be
    viewed (vLLM's own unpack_tensor fails there): that piece is copied."""
    if part.storage_offset() % dtype.itemsize:
        part = part.clone()
    return part.view(dtype).reshape(shape)
