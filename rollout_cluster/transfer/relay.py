"""The weight relay: a trainer's communicator of fixed size on one side, the elastic fleet on the
other (docs/architecture.md, "Weights without a filesystem").

TRL's client (and vLLM's weight-transfer API) broadcast a model's tensors to the ranks of one
group whose size the trainer fixes when it joins. The fleet's size is not fixed: replicas join,
leave and die during a run. So the trainer's group has exactly two ranks, the trainer's and the
relay's (the Gateway reports a world size of 1), and the relay hands what it received to the
fleet as push_weights does (`commit`: buckets in Ray's object store, every replica, and later
joiners, load them). A replica that dies mid-update leaves the trainer's group untouched.

Two protocols fill the relay:
- TRL <= 1.10: `open_trl` (/init_communicator/), then `receive_param` per tensor
  (/update_named_param/, answered before the tensor arrives: the client broadcasts after the
  answer). There is no "done" message, so the relay commits once it holds every tensor of the
  served checkpoint, and at `settle` (/reset_prefix_cache/, which TRL calls after an update) or
  `close` otherwise.
- vLLM's weight-transfer API (TRL >= 1.11): `open_vllm` (/init_weight_transfer_engine),
  `start` (/start_weight_update), `receive_packed` (/update_weights: packed chunks, cut where
  vLLM's packed_nccl_broadcast_consumer cuts them), `finish` (/finish_weight_update commits).
The methods block (rendezvous, receive, the fleet's load); the Gateway runs them one at a time
on a thread of their own, in the order the requests came. No Ray and no HTTP here.

Retries. TRL's client retries a POST whose answer was lost (and a 500, 502 or 503) with the same
body and no request id, and the trainer sends each tensor once. One update names each tensor
once (a new update starts after the commit, or at /start_weight_update), so a request identical
to the one before it, in the same update, is that request retried, and is answered as the first
was without receiving again (a second receive would wait for bytes that never come):
- TRL <= 1.10: the tensor follows the answer (and the trainer joins after /init_communicator/'s),
  so a retry comes before its tensor arrived (or the group opened): `announce`, called before
  the answer, returns False for the request whose step is queued and has not got that far, and
  the route queues nothing;
- vLLM's API: the answer follows the tensors, so a retried /update_weights comes once the first
  one's receive is done: `receive_packed` returns at once for the announcement that the last
  receive of this update completed; and `finish` with nothing staged answers the version its
  commit gave (or fails again where that commit failed) while no update has started since.
A request naming a tensor this update already holds, but not the previous one retried, is a
new send: received, it replaces the tensor.

Bounds. `spec` ({name: shape}, engines/weight_checks.served_weights: the checkpoint's headers,
else the model its config describes) refuses any other name or shape before a byte is
allocated; without one, `max_bytes` caps a tensor and the tensors staged in one update. A
refused /update_weights is still received (and dropped) before its answer, as far as its pieces
are bounded: the trainer broadcasts while it waits for that answer (`_drain`).
"""
from __future__ import annotations

import math
import threading
from typing import Callable, Optional

from .channels import nbytes_of, open_channel
from .relay_checks import (DEFAULT_PACKED_BUFFER_BYTES, RelayError, check_address, check_init_info, check_integer,
                           check_shape, packed_chunks, torch_dtype)

__all__ = ["RelayError", "WeightRelay", "packed_chunks", "torch_dtype"]


class WeightRelay:
    def __init__(self, spec: Optional[dict], commit: Callable[[list], int], backend: str, timeout_s: float = 300.0,
                 max_bytes: Optional[int] = None):
        self.spec = spec  # {name: shape} of the served model, or None (nothing to build it from): what may arrive
        self.max_bytes = max_bytes  # without a spec: what one tensor, and one update's, may take; None: no cap
        self.commit_fn = commit  # (name, tensor) pairs -> the version every replica now holds
        self.backend = backend  # "cpu" or "nccl" (channels.py)
        self.timeout_s = timeout_s  # how long a rendezvous or a tensor may take to arrive
        self.channel = None  # the open group, or None
        self.protocol: Optional[str] = None  # "trl" (<= 1.10) or "vllm" (weight-transfer API) while open
        self.buffer_bytes = DEFAULT_PACKED_BUFFER_BYTES  # the vLLM protocol's packed chunk size
        self.staged: dict = {}  # name -> host tensor received since the last commit
        self.version: Optional[int] = None  # the version of the last commit
        self.error: Optional[str] = None  # why a background step (TRL <= 1.10's) failed, for the next call
        self.announced: Optional[tuple] = None  # the TRL <= 1.10 step queued whose tensor (or trainer) is due
        self.announce_lock = threading.Lock()  # announce (the event loop) against _arrived (the relay's thread)
        self.last_packed: Optional[tuple] = None  # the announcement this update's last receive_packed completed
        self.finished: Optional[int] = None  # the version finish() committed, until the next update starts
        self.finish_error: Optional[str] = None  # why finish()'s commit failed, until the next update starts

    # -- TRL <= 1.10 --------------------------------------------------------------------------
    @staticmethod
    def check_trl(host, port, world_size) -> None:
        """What /init_communicator/ must carry; checked before its answer (the group opens after)."""
        check_integer("world_size", world_size)
        if world_size != 2:
            raise RelayError("world_size", f"{world_size!r}: must be 2 (the relay's rank 0 and the trainer's "
                                           "rank 1: /get_world_size/ answers 1)")
        check_address(host, port)

    def announce(self, method: str, *args) -> bool:
        """Before /init_communicator/ or /update_named_param/ queues `method`: False where the step
        announced last is this one and has not yet got its trainer or tensor (a retried request)."""
        step = (method, *args)
        with self.announce_lock:
            if step == self.announced:
                return False
            self.announced = step
            return True

    def _arrived(self, *step) -> None:
        with self.announce_lock:
            if self.announced == step:  # not a later step's: that one is still due
                self.announced = None

    def open_trl(self, host: str, port: int, world_size: int) -> None:
        try:
            self.check_trl(host, port, world_size)
            self._open("trl", host, port, rank=0, src=1)
        finally:
            self._arrived("open_trl", host, port, world_size)

    def receive_param(self, name: str, dtype: str, shape: list) -> Optional[int]:
        """One tensor from the trainer; commits (returning the version) once every checkpoint
        tensor is here."""
        try:
            self._expect("trl")
            shape, torch_type = self.check_param(name, dtype, shape)
            self._check_update_bytes("name", {name: nbytes_of(shape, torch_type)})
            t = self.channel.receive(shape, torch_type)
        finally:  # arrived, or never will: a request like this one is new from now on
            self._arrived("receive_param", name, dtype, shape)
        self.channel.barrier()
        self.staged[name] = t
        if self.spec is not None and set(self.spec) <= set(self.staged):
            return self.commit()
        return None

    def settle(self) -> Optional[int]:
        """What TRL <= 1.10 sent is in the fleet before its next request (/reset_prefix_cache/)."""
        self._raise_error()
        return self.commit() if self.staged and self.protocol == "trl" else None

    # -- vLLM's weight-transfer API (TRL >= 1.11) ----------------------------------------------
    def open_vllm(self, info: dict) -> None:
        size = check_init_info(info)
        self._open("vllm", info["master_address"], info["master_port"], rank=1, src=0)
        self.buffer_bytes = size

    def start(self) -> None:
        self._expect("vllm")
        self.staged, self.last_packed, self.finished, self.finish_error = {}, None, None, None

    def receive_packed(self, info: dict) -> None:
        """/update_weights: the announced tensors, in packed chunks (or one at a time). A refused
        announcement whose sizes are known is received all the same and dropped (`_drain`)."""
        self._expect("vllm")
        names, metas, packed = self._announcement(info)
        announced = (tuple(names), tuple((tuple(s), d) for s, d in metas), packed)
        if announced == self.last_packed and all(n in self.staged for n in names):
            return  # the last request of this update, retried: its tensors arrived already
        self.last_packed, self.finished, self.finish_error = None, None, None
        sizes = [nbytes_of(shape, dtype) for shape, dtype in metas]
        try:
            for i, (name, (shape, _)) in enumerate(zip(names, metas)):
                self.check_tensor(name, shape, f"update_info.names[{i}]")
            self._check_update_bytes("update_info.names", dict(zip(names, sizes)))
        except RelayError as refusal:
            raise self._drain(metas, sizes, packed, refusal) from None
        for i, tensor in self._receive(metas, sizes, packed):
            self.staged[names[i]] = tensor
        self.last_packed = announced

    def _announcement(self, info) -> tuple:
        """(names, [(shape, torch dtype)], packed) of an /update_weights body, checked for form
        (lists of one length, floating-point dtypes, shapes of integers >= 0): what a receive needs."""
        if not isinstance(info, dict):
            raise RelayError("update_info", f"{str(info)[:80]!r}: must be an object")
        names, dtypes, shapes = (info.get(k) for k in ("names", "dtype_names", "shapes"))
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)) or not (
                len(names) == len(dtypes) == len(shapes)):
            raise RelayError("update_info", "names, dtype_names and shapes must be lists of one length")
        metas = [(check_shape(s, f"update_info.shapes[{i}]"), torch_dtype(f"update_info.dtype_names[{i}]", d))
                 for i, (d, s) in enumerate(zip(dtypes, shapes))]
        return names, metas, bool(info.get("packed", True))

    def _receive(self, metas: list, sizes: list, packed: bool):
        """(index, tensor) of each announced tensor as it arrives."""
        if packed:
            import torch

            for chunk in packed_chunks(sizes, self.buffer_bytes):
                buf = self.channel.receive([sum(sizes[i] for i in chunk)], torch.uint8)
                for i, part in zip(chunk, buf.split([sizes[i] for i in chunk])):
                    yield i, part.view(metas[i][1]).reshape(metas[i][0])
        else:
            for i, (shape, dtype) in enumerate(metas):
                yield i, self.channel.receive(shape, dtype)

    def _drain(self, metas: list, sizes: list, packed: bool, refusal: RelayError) -> RelayError:
        """The error to answer a refused announcement with, once its tensors are taken and dropped.
        TRL >= 1.11 and vLLM's trainer broadcast while their /update_weights is in flight, and a
        broadcast no one receives never ends (NCCL's has no timeout): answered at once, the
        refusal would reach a trainer that is stuck. So the relay receives what was announced,
        one piece at a time into memory dropped at once, where no piece is larger than one of the
        served model's (`drain_bound`); a larger one is refused at once, and says why."""
        pieces = [sum(sizes[i] for i in c) for c in packed_chunks(sizes, self.buffer_bytes)] if packed else sizes
        bound = self.drain_bound()
        if max(pieces, default=0) > bound:
            return RelayError(refusal.field, f"{refusal.message} (its {max(pieces)}-byte piece was not received: "
                                             f"more than {bound}; a trainer broadcasting it waits until its "
                                             "group times out)")
        try:
            for _ in self._receive(metas, sizes, packed):
                pass
        except Exception as e:  # the trainer sent something else, or nothing: the refusal still names the field
            return RelayError(refusal.field, f"{refusal.message} (receiving the refused tensors failed too: {e})")
        return refusal

    def drain_bound(self) -> int:
        """The largest piece a refused announcement is received in: a packed chunk of the served
        model (the chunk size plus its largest tensor at 8 bytes an element)."""
        if self.spec:
            largest = 8 * max(math.prod(shape) for shape in self.spec.values())
        else:
            largest = self.max_bytes or 0
        return self.buffer_bytes + largest

    def finish(self) -> Optional[int]:
        """Commits this update (its version); retried after that, answers the same version."""
        self._expect("vllm")
        if self.staged:
            self.last_packed = None
            try:
                self.finished = self.commit()
            except Exception as e:  # the staged tensors are gone: a retry must not answer success
                self.finish_error = f"{type(e).__name__}: {e}"
                raise
        elif self.finish_error is not None:
            raise RuntimeError(f"this update's commit failed: {self.finish_error}")
        return self.finished

    # -- both ----------------------------------------------------------------------------------
    def commit(self) -> int:
        staged, self.staged = self.staged, {}
        self.version = self.commit_fn(list(staged.items()))
        return self.version

    def close(self) -> Optional[int]:
        """Commits what TRL <= 1.10 left staged, and leaves the group."""
        try:
            return self.settle() if self.protocol == "trl" else None
        finally:
            if self.channel is not None:
                self.channel.close()
            self.channel, self.protocol, self.staged = None, None, {}
            self.last_packed, self.finished, self.finish_error = None, None, None

    def describe(self) -> dict:
        return {"backend": self.backend, "protocol": self.protocol, "staged_tensors": len(self.staged),
                "version": self.version, "error": self.error}

    def _open(self, protocol: str, host, port, rank: int, src: int) -> None:
        check_address(host, port)
        if self.channel is not None:
            self.close()  # a trainer that restarted joins again: the old group is gone
        self.error = None
        self.channel = open_channel(self.backend, host, port, rank, 2, src, self.timeout_s)
        self.protocol, self.staged, self.last_packed, self.finished = protocol, {}, None, None
        self.finish_error = None

    def _expect(self, protocol: str) -> None:
        self._raise_error()
        if self.channel is None or self.protocol != protocol:
            route = "/init_communicator/" if protocol == "trl" else "/init_weight_transfer_engine"
            raise RelayError("communicator", f"none open for this protocol: call {route} first")

    def _raise_error(self) -> None:
        if self.error:
            error, self.error = self.error, None
            raise RelayError("update", f"an earlier step failed: {error}")

    def check_param(self, name, dtype, shape) -> tuple:
        """What /update_named_param/ must carry, checked before its answer: (shape, torch dtype)."""
        shape, dtype = self.check_tensor(name, shape, "name"), torch_dtype("dtype", dtype)
        if self.max_bytes is not None and nbytes_of(shape, dtype) > self.max_bytes:
            raise RelayError("shape", f"{shape} of {dtype} for {name!r}: {nbytes_of(shape, dtype)} bytes, more than "
                                      f"the served model's bound of {self.max_bytes} (twice its size in float32)")
        return shape, dtype

    def _check_update_bytes(self, field: str, sizes: dict) -> None:
        """Without a spec: the update, with these tensors staged (replacing any of their names), fits max_bytes."""
        if self.max_bytes is None:
            return
        total = sum(t.nbytes for n, t in self.staged.items() if n not in sizes) + sum(sizes.values())
        if total > self.max_bytes:
            raise RelayError(field, f"{list(sizes)[:3]}: this update would hold {total} bytes, more than the served "
                                    f"model's bound of {self.max_bytes} (twice its size in float32)")

    def check_tensor(self, name, shape, field: str) -> list:
        if not isinstance(name, str) or not name:
            raise RelayError(field, f"{name!r}: must be a tensor name")
        shape = check_shape(shape, f"{field} shape")
        if self.spec is not None:
            if name not in self.spec:
                raise RelayError(field, f"{name!r}: the served model has no such weight")
            if tuple(shape) != tuple(self.spec[name]):
                raise RelayError(field, f"{name!r}: shape {list(shape)}, the served model's is {list(self.spec[name])}")
        return list(shape)
