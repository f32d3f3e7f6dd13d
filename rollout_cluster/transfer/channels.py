"""The data plane between one trainer process and the weight relay (relay.py): a group of two
ranks, the trainer's tensors broadcast from its rank to the relay's, one tensor or packed chunk
at a time, in order.

Two backends, chosen by where the relay runs (`relay_backend`):
- "nccl" (the relay's process sees a CUDA device): vLLM's own StatelessProcessGroup rendezvous
  and PyNcclCommunicator, as TRL's VLLMClient and vLLM's NCCL weight-transfer engine use them,
  so TRL's unchanged client joins it. It needs GPUs: the two-GPU run proves it.
- "cpu": a TCPStore of the same address and port as the rendezvous, and each tensor's raw bytes
  under a numbered key, acknowledged by the receiver before the next is sent (at most one
  tensor in the store). Raw bytes, never pickles: a peer that reaches the port cannot make the
  relay run code. `CpuSender` is the trainer's side; a trainer without GPUs uses it (the tests'
  stand-in for TRL's client does).

Rendezvous as the two protocols place it: TRL <= 1.10 (/init_communicator/) makes the server's
side rank 0, which hosts the store, and the trainer the last rank; vLLM's weight-transfer API
(/init_weight_transfer_engine, TRL >= 1.11) makes the trainer rank 0 and host.
"""
from __future__ import annotations

import math
from datetime import timedelta

KEY = "rollout/weights/"  # data keys: KEY + "<n>", acknowledged by KEY + "<n>/ack"


def relay_backend() -> str:
    """"nccl" where this process sees a CUDA device, else "cpu"."""
    import torch

    return "nccl" if torch.cuda.is_available() else "cpu"


def _store(host: str, port: int, world_size: int, is_master: bool, timeout_s: float):
    from torch.distributed import TCPStore

    return TCPStore(host, port, world_size, is_master, timedelta(seconds=timeout_s), wait_for_workers=False)


def nbytes_of(shape, dtype) -> int:
    return math.prod(shape) * dtype.itemsize


class CpuChannel:
    """The relay's end over a TCPStore: receive(shape, dtype) returns the next tensor sent."""

    backend = "cpu"

    def __init__(self, host: str, port: int, world_size: int, hosts_store: bool, timeout_s: float = 300.0):
        self.store = _store(host, port, world_size, hosts_store, timeout_s)
        self.received = 0  # tensors received so far (the next key's number)

    def receive(self, shape, dtype):
        import torch

        key = f"{KEY}{self.received}"
        data = self.store.get(key)  # waits for the sender, up to the store's timeout
        # taken whatever it holds: a refused tensor is received too, so that the trainer's send
        # ends (as an NCCL broadcast would) and the next receive reads the next tensor
        self.store.delete_key(key)
        self.store.set(f"{key}/ack", b"1")
        self.received += 1
        want = nbytes_of(shape, dtype)
        if len(data) != want:
            raise ValueError(f"tensor {self.received - 1}: {len(data)} bytes arrived, {want} announced "
                             f"(shape {list(shape)}, dtype {dtype})")
        out = torch.frombuffer(bytearray(data), dtype=torch.uint8) if want else torch.empty(0, dtype=torch.uint8)
        return out.view(dtype).reshape(shape)

    def barrier(self) -> None:
        """Nothing to wait for: receive() acknowledged the tensor already."""

    def close(self) -> None:
        self.store = None

    def abort(self) -> None:
        """Nothing to end: a receive waiting here raises at the store's timeout by itself."""


class CpuSender:
    """The trainer's end of the CPU channel: send(tensor) puts its bytes in the store and waits
    until the relay took them."""

    def __init__(self, host: str, port: int, world_size: int, hosts_store: bool, timeout_s: float = 300.0):
        self.store = _store(host, port, world_size, hosts_store, timeout_s)
        self.sent = 0  # tensors sent so far

    def send(self, tensor) -> None:
        import torch

        t = tensor.detach().to("cpu").contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        key = f"{KEY}{self.sent}"
        self.store.set(key, data)
        self.store.get(f"{key}/ack")  # waits until the relay has it: one tensor in the store at a time
        self.store.delete_key(f"{key}/ack")
        self.sent += 1


class NcclChannel:
    """The relay's end over NCCL, as a vLLM worker joins TRL's group: receive() into this
    process's CUDA device, then to host memory (the relay hands host tensors to the fleet)."""

    backend = "nccl"

    def __init__(self, host: str, port: int, rank: int, world_size: int, src: int, timeout_s: float = 300.0):
        import torch
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        group = StatelessProcessGroup.create(host=host, port=port, rank=rank, world_size=world_size,
                                             store_timeout=int(timeout_s))
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.comm = PyNcclCommunicator(group, device=self.device)
        self.src = src  # the trainer's rank
        # a stream of its own (not the default one, which every other stream waits for): a broadcast
        # whose sender died spins on it until aborted, and must not hold up the next group's
        self.stream = torch.cuda.Stream(self.device)

    def receive(self, shape, dtype):
        """The next tensor, on the host. NCCL's broadcast has no timeout: where the trainer died,
        this waits (in the copy to the host) until abort() or for ever."""
        import torch

        with torch.cuda.stream(self.stream):
            t = torch.empty(shape, dtype=dtype, device=self.device)
            self.comm.broadcast(t, src=self.src, stream=self.stream)
            return t.to("cpu")

    def barrier(self) -> None:
        self.comm.group.barrier()

    def close(self) -> None:
        """Frees the communicator (its NCCL buffers on the device: a relay opens one per trainer
        session). The last broadcast has returned, so ncclCommAbort, vLLM's destroy, has nothing to
        stop; vLLM releases without `destroy` drop it unfreed."""
        comm, self.comm = self.comm, None
        destroy = getattr(comm, "destroy", None)
        if destroy is not None:
            destroy()

    def abort(self) -> None:
        """Ends the group from another thread while a receive waits on a trainer that is gone:
        ncclCommAbort (PyNcclCommunicator.destroy; safe where the peer is gone) stops the waiting
        kernel, and the receive returns or raises instead of waiting for ever. Not tried on GPUs
        yet: where it does not end the wait, the relay has abandoned that thread all the same."""
        comm, self.comm = self.comm, None
        if comm is not None:
            comm.destroy()


def open_channel(backend: str, host: str, port: int, rank: int, world_size: int, src: int, timeout_s: float):
    """The relay's end of a group of `world_size` ranks where it is `rank` and the trainer `src`."""
    if backend == "nccl":
        return NcclChannel(host, port, rank, world_size, src, timeout_s)
    if backend == "cpu":
        return CpuChannel(host, port, world_size, hosts_store=(rank == 0), timeout_s=timeout_s)
    raise ValueError(f"backend={backend!r}: must be 'cpu' or 'nccl'")
