"""What the weight relay (relay.py) accepts from a trainer, checked before a byte is received:
the fields of its requests (each refusal names one), and how vLLM's packer cuts tensors into the
chunks the trainer broadcasts."""
from __future__ import annotations

DEFAULT_PACKED_BUFFER_BYTES = 1 << 30  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES


class RelayError(ValueError):
    """A request the relay refuses; the message names the field and the value."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


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


def check_address(host, port) -> None:
    if not isinstance(host, str) or not host:
        raise RelayError("host", f"{host!r}: must be a host name or address")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise RelayError("port", f"{port!r}: must be a TCP port")


def check_init_info(info) -> int:
    """vLLM's init_info for /init_weight_transfer_engine, checked before the relay joins the group
    (the trainer's rank 0 and the relay's rank 1); its packed_buffer_size_bytes."""
    if not isinstance(info, dict):
        raise RelayError("init_info", f"{str(info)[:80]!r}: must be an object")
    for key in ("master_address", "master_port", "rank_offset", "world_size"):
        if key not in info:
            raise RelayError(f"init_info.{key}", "missing (the relay joins by TCP rendezvous)")
    for key in ("rank_offset", "world_size"):
        check_integer(f"init_info.{key}", info[key])
    if info["world_size"] != 2 or info["rank_offset"] != 1:
        raise RelayError("init_info.world_size", f"{info['world_size']!r} with rank_offset "
                         f"{info['rank_offset']!r}: must be 2 and 1 (the trainer's rank 0 and the relay's "
                         "rank 1: /get_world_size answers 1)")
    size = info.get("packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_BYTES)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise RelayError("init_info.packed_buffer_size_bytes", f"{size!r}: must be an integer >= 1")
    return size


def check_shape(shape, field: str) -> list:
    if not (isinstance(shape, (list, tuple)) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                      for d in shape)):
        raise RelayError(field, f"{shape!r}: must be a list of integers >= 0")
    return list(shape)


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
