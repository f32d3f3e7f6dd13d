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
  answer; so `accept_param` checks, before that answer, all that needs no byte of it). There
  is no "done" message, so the relay commits once it holds every tensor of the served
  checkpoint, and at `settle` (/reset_prefix_cache/, which TRL calls after an update) or `close`
  otherwise; a new init drops what the last trainer left half sent.
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
allocated; without one, `max_bytes` caps a tensor and the tensors staged in one update; and
whatever the model, no tensor passes `max_tensor_bytes` nor an update `max_update_bytes`
(relay_checks.py). A refused /update_weights is still received (and dropped) before its answer,
as far as its pieces are bounded: the trainer broadcasts while it waits for that answer (`_drain`).

Failures. A half update is never committed: tensors staged when a step fails (a receive that
broke, a communicator given up) or when a new init comes (a restarted trainer's) are dropped,
and the log and `describe()` say so; /finish_weight_update after a failed /update_weights answers
that failure until the next /start_weight_update. Every blocking wait says what it waits for
and how long it may take (`waiting`): the runner's watchdog (serve/protocols/relay_runner.py)
gives up a step stuck past that (an NCCL receive has no timeout of its own) with `give_up`. The
waits, and which steps were given up, are kept by relay_waits.py (`self.waits`).
"""
from __future__ import annotations

import logging
import threading
from typing import Callable, Optional

from .channels import nbytes_of, open_channel
from .relay_checks import (DEFAULT_PACKED_BUFFER_BYTES, MAX_TENSOR_BYTES, MAX_UPDATE_BYTES, Bounds, RelayError,
                           RelayTimeout, check_address, check_bool, check_init_info, check_integer, check_shape,
                           packed_chunks, torch_dtype, unpacked)
from .relay_waits import GivenUp, RelayWaits, Waiting

__all__ = ["GivenUp", "RelayError", "RelayTimeout", "Waiting", "WeightRelay", "packed_chunks", "torch_dtype"]

log = logging.getLogger(__name__)


class WeightRelay:
    def __init__(self, spec: Optional[dict], commit: Callable[[list], int], backend: str, timeout_s: float = 300.0,
                 max_bytes: Optional[int] = None, max_tensor_bytes: int = MAX_TENSOR_BYTES,
                 max_update_bytes: int = MAX_UPDATE_BYTES, commit_timeout_s: float = 600.0):
        self.spec = spec  # {name: shape} of the served model, or None (nothing to build it from): what may arrive
        self.bounds = Bounds(spec, max_bytes, max_tensor_bytes, max_update_bytes)  # what a tensor, an update may take
        self.commit_fn = commit  # (name, tensor) pairs -> the version every replica now holds
        self.backend = backend  # "cpu" or "nccl" (channels.py)
        self.timeout_s = timeout_s  # how long a rendezvous or a tensor may take to arrive
        self.commit_timeout_s = commit_timeout_s  # how long the fleet's commit may take (its push's own timeout)
        self.channel = None  # the open group, or None
        self.protocol: Optional[str] = None  # "trl" (<= 1.10) or "vllm" (weight-transfer API) while open
        self.buffer_bytes = DEFAULT_PACKED_BUFFER_BYTES  # the vLLM protocol's packed chunk size
        self.packed = True  # whether vLLM's trainer sends packed chunks (init_info; update_info may override)
        self.staged: dict = {}  # name -> host tensor received since the last commit
        self.version: Optional[int] = None  # the version of the last commit
        self.error: Optional[str] = None  # why a background step (TRL <= 1.10's) failed, for the next call
        self.announced: Optional[tuple] = None  # the TRL <= 1.10 step queued whose tensor (or trainer) is due
        self.promised: dict = {}  # name -> bytes of TRL <= 1.10 tensors answered and not yet received
        self.announce_lock = threading.Lock()  # announce (the event loop) against _arrived (the relay's thread)
        self.last_packed: Optional[tuple] = None  # the announcement this update's last receive_packed completed
        self.finished: Optional[int] = None  # the version finish() committed, until the next update starts
        self.finish_error: Optional[str] = None  # why finish()'s commit failed, until the next update starts
        self.update_failed: Optional[str] = None  # why this vLLM update cannot be committed, until the next starts
        self.dropped: Optional[str] = None  # the last staged tensors dropped uncommitted, and why
        self.gave_up: Optional[str] = None  # why the last communicator was given up (a step stuck)
        # the wait under way and the steps given up, read by the runner's watchdog (relay_waits.py)
        self.waits = RelayWaits()

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
            if self.announced == step and self.waits.mine():  # not a later step's: that one is still due
                self.announced = None

    def accept_param(self, name, dtype, shape, opening: bool) -> bool:
        """/update_named_param/, before its answer (the trainer broadcasts after it, so a refusal
        later reaches no one): its fields and bounds, an open group (or one `opening`: an init
        queued before it), the update's bytes with the tensors answered before it, and an earlier
        step's failure (answered once). True: queue receive_param; False: the one queued, retried."""
        shape, torch_type = self.check_param(name, dtype, shape)
        self._raise_error()
        if not opening and (self.channel is None or self.protocol != "trl"):
            raise self._none_open("trl")
        with self.announce_lock:
            self._check_update_bytes("shape", {name: nbytes_of(shape, torch_type)})
        if not self.announce("receive_param", name, dtype, shape):
            return False
        with self.announce_lock:
            self.promised[name] = nbytes_of(shape, torch_type)
        return True

    def open_trl(self, host: str, port: int, world_size: int) -> None:
        try:
            self.check_trl(host, port, world_size)
            self._open("trl", host, port, rank=0, src=1)
        finally:
            self._arrived("open_trl", host, port, world_size)

    def receive_param(self, name: str, dtype: str, shape: list) -> Optional[int]:
        """One tensor from the trainer; commits (returning the version) once every checkpoint
        tensor is here. Failing, it drops the update staged so far (its error is answered once,
        by the next request: `error`, set by the runner)."""
        try:
            if self.error:  # not consumed here: the next request answers it, once
                raise RelayError("update", f"an earlier step failed: {self.error}")
            if self.channel is None or self.protocol != "trl":
                raise self._none_open("trl")
            shape, torch_type = self.check_param(name, dtype, shape)
            with self.announce_lock:
                self._check_update_bytes("shape", {name: nbytes_of(shape, torch_type)})
            with self.waits.wait(f"tensor {name!r}", self.timeout_s):
                t = self.channel.receive(shape, torch_type)
                self.channel.barrier()
        except GivenUp:
            raise
        except Exception as e:
            self._drop(f"receiving {name!r} failed: {e}")
            raise
        finally:  # arrived, or never will: a request like this one is new from now on
            self._arrived("receive_param", name, dtype, shape)
            with self.announce_lock:
                if self.waits.mine():
                    self.promised.pop(name, None)
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
        wire = check_init_info(info)
        self._open("vllm", info["master_address"], info["master_port"], rank=1, src=0)
        self.buffer_bytes, self.packed = wire.buffer_bytes, wire.packed

    def start(self) -> None:
        self._expect("vllm")
        self._drop("a new update started before this one was finished")
        self.last_packed, self.finished, self.finish_error, self.update_failed = None, None, None, None

    def receive_packed(self, info: dict) -> None:
        """/update_weights: the announced tensors, in packed chunks (or one at a time). A refused
        announcement whose sizes are known is received all the same and dropped (`_drain`); a
        receive that fails, or a refusal, leaves this update failed (`update_failed`), its tensors
        dropped: /finish_weight_update answers the failure, and commits none of the update."""
        self._expect("vllm")
        try:
            names, metas, packed = self._announcement(info)
        except RelayError as refusal:
            self._fail_update(refusal)
            raise
        announced = (tuple(names), tuple((tuple(s), d) for s, d in metas), packed)
        if announced == self.last_packed and all(n in self.staged for n in names):
            return  # the last request of this update, retried: its tensors arrived already
        self.last_packed, self.finished, self.finish_error = None, None, None
        sizes = [nbytes_of(shape, dtype) for shape, dtype in metas]
        try:
            for i, (name, (shape, dtype)) in enumerate(zip(names, metas)):
                self.bounds.tensor(name, shape, dtype, f"update_info.names[{i}]", f"update_info.shapes[{i}]")
            self._check_update_bytes("update_info.names", dict(zip(names, sizes)))
        except RelayError as refusal:
            drained = self._drain(metas, sizes, packed, refusal)
            self._fail_update(refusal)
            raise drained from None
        try:
            for i, tensor in self._receive(metas, sizes, packed):
                self.staged[names[i]] = tensor
        except GivenUp:
            raise
        except Exception as e:
            self.update_failed = f"/update_weights of {names[:3]}: {type(e).__name__}: {e}"
            self._drop(f"this update failed: {self.update_failed}")
            raise
        self.last_packed = announced

    def _fail_update(self, refusal: "RelayError") -> None:
        """A refused /update_weights fails its whole update (TRL's weight_update() block finishes it
        all the same): a half update is never committed."""
        self.update_failed = f"/update_weights refused: {refusal}"
        self._drop(f"this update failed: {self.update_failed}")

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
        # vLLM < 0.28 sends `packed` here; later ones at init (self.packed)
        packed = check_bool("update_info.packed", info["packed"]) if "packed" in info else self.packed
        return names, metas, packed

    def _receive(self, metas: list, sizes: list, packed: bool):
        """(index, tensor) of each announced tensor as it arrives."""
        if packed:
            import torch

            for n, chunk in enumerate(packed_chunks(sizes, self.buffer_bytes)):
                with self.waits.wait(f"packed chunk {n} (tensors {chunk[0]}..{chunk[-1]} of the announcement)",
                                     self.timeout_s):
                    buf = self.channel.receive([sum(sizes[i] for i in chunk)], torch.uint8)
                for i, part in zip(chunk, buf.split([sizes[i] for i in chunk])):
                    yield i, unpacked(part, metas[i][0], metas[i][1])
        else:
            for i, (shape, dtype) in enumerate(metas):
                with self.waits.wait(f"tensor {i} of the announcement", self.timeout_s):
                    t = self.channel.receive(shape, dtype)
                yield i, t

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
        except GivenUp:
            raise
        except Exception as e:  # the trainer sent something else, or nothing: the refusal still names the field
            return RelayError(refusal.field, f"{refusal.message} (receiving the refused tensors failed too: {e})")
        return refusal

    def drain_bound(self) -> int:
        return self.bounds.drain_bound(self.buffer_bytes)

    def finish(self) -> Optional[int]:
        """Commits this update (its version); retried after that, answers the same version. After
        a failed /update_weights, commits nothing and answers that failure."""
        self._expect("vllm")
        if self.update_failed is not None:
            self._drop(f"this update failed: {self.update_failed}")
            self.last_packed = None
            raise RelayError("update", f"an earlier /update_weights of this update failed, so nothing was committed: "
                                       f"{self.update_failed}; send the update again from /start_weight_update")
        if self.staged:
            self.last_packed = None
            try:
                self.finished = self.commit()
            except GivenUp:
                raise
            except Exception as e:  # the staged tensors are gone: a retry must not answer success
                self.finish_error = f"{type(e).__name__}: {e}"
                raise
        elif self.finish_error is not None:
            raise RuntimeError(f"this update's commit failed: {self.finish_error}")
        return self.finished

    # -- both ----------------------------------------------------------------------------------
    def commit(self) -> int:
        staged, self.staged = self.staged, {}
        with self.waits.wait(f"the fleet's commit of {len(staged)} tensors", self.commit_timeout_s):
            version = self.commit_fn(list(staged.items()))
        self.version = version
        return version

    def close(self) -> Optional[int]:
        """Commits what TRL <= 1.10 left staged, and leaves the group."""
        try:
            return self.settle() if self.protocol == "trl" else None
        finally:
            if self.waits.mine():  # a given-up step's group is gone already; the one open now is another's
                self._leave("the communicator closed")

    def describe(self) -> dict:
        return {"backend": self.backend, "protocol": self.protocol, "staged_tensors": len(self.staged),
                "version": self.version, "error": self.error, "update_failed": self.update_failed,
                "dropped": self.dropped, "given_up": self.gave_up}

    def give_up(self, thread: threading.Thread, reason: str):
        """The runner's watchdog found the step on `thread` stuck (`reason`): its group is
        forgotten, what it staged is dropped, and whatever that thread does if its wait ever ends
        is discarded (`GivenUp`). The next init opens a new group. Returns the forgotten channel,
        for the caller to abort (`abort()` may block a while: not under the caller's lock)."""
        channel = self.channel
        self.waits.give_up(thread)
        self._drop(f"the communicator was given up: {reason}")
        self.channel, self.protocol, self.gave_up = None, None, reason
        self.last_packed, self.finished, self.finish_error, self.update_failed = None, None, None, None
        with self.announce_lock:
            self.announced, self.promised = None, {}
        return channel

    def _open(self, protocol: str, host, port, rank: int, src: int) -> None:
        check_address(host, port)
        # a trainer that restarted joins again: the old group is gone, and the update it left half sent with it
        self._drop("a new init came before this update was committed")
        self._leave("a new init came")
        self.error = None
        channel = None
        try:
            with self.waits.wait(f"the trainer's rendezvous at {host}:{port}", 2 * self.timeout_s):
                channel = open_channel(self.backend, host, port, rank, 2, src, self.timeout_s)
        except GivenUp:
            if channel is not None:
                channel.close()
            raise
        self.channel, self.protocol, self.gave_up = channel, protocol, None

    def _leave(self, reason: str) -> None:
        if self.channel is not None:
            self.channel.close()
        self._drop(reason)
        self.channel, self.protocol = None, None
        self.last_packed, self.finished, self.finish_error, self.update_failed = None, None, None, None

    def _drop(self, reason: str) -> None:
        """Drops the staged tensors, uncommitted, and says so (the log, `dropped`)."""
        if self.staged:
            names = list(self.staged)
            self.dropped = (f"{len(names)} staged tensors ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) "
                            f"dropped, not committed: {reason}")
            log.warning("weight relay: %s", self.dropped)
        self.staged = {}

    def _expect(self, protocol: str) -> None:
        self._raise_error()
        if self.channel is None or self.protocol != protocol:
            raise self._none_open(protocol)

    def _none_open(self, protocol: str) -> RelayError:
        route = "/init_communicator/" if protocol == "trl" else "/init_weight_transfer_engine"
        why = f" (the last was given up: {self.gave_up})" if self.gave_up else ""
        return RelayError("communicator", f"none open for this protocol{why}: call {route} first")

    def _raise_error(self) -> None:
        if self.error:
            error, self.error = self.error, None
            raise RelayError("update", f"an earlier step failed: {error}")

    def check_param(self, name, dtype, shape) -> tuple:
        """What /update_named_param/ must carry, checked before its answer: (shape, torch dtype)."""
        shape, torch_type = check_shape(shape, "shape"), torch_dtype("dtype", dtype)
        self.bounds.tensor(name, shape, torch_type, "name", "shape")
        return shape, torch_type

    def _check_update_bytes(self, field: str, sizes: dict) -> None:
        """The update, with these tensors staged besides those answered and not yet received, fits."""
        held = {n: t.nbytes for n, t in dict(self.staged).items()}
        self.bounds.update(field, {**held, **self.promised}, sizes)
