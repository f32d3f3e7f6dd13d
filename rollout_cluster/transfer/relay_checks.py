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


def check_address(host, port) -> None:
    if not isinstance(host, str) or not host:
        raise RelayError("host", f"{host!r}: must be a host name or address")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise RelayError("port", f"{port!r}: must be a TCP port")


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
