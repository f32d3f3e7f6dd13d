"""Host memory a push copies the trainer's tensors into, reused bucket after bucket.

Without it, `tensor.to("cpu")` of a GPU tensor allocates fresh pageable memory per tensor (the
kernel faults every page in) and CUDA copies through its own pinned bounce buffer; then `ray.put`
copies the bucket once more into the object store. With a `Staging`, each tensor of a bucket is
copied once (D2H, asynchronous, into pinned memory when the tensor is on a GPU) into one buffer,
the bucket's arrays view the buffer, and the next bucket reuses the same memory: so a bucket's
bytes are good only until the next bucket is asked for. `transfer/push.py` puts each bucket into
the object store before it asks (`ray.put` copies); a caller that keeps buckets must not pass one.

CPU tensors that are contiguous already are viewed, not copied (as `buckets.pack` does without
staging); a non-contiguous one is copied into the buffer too.
"""
from __future__ import annotations

import contextlib
import logging
import threading

log = logging.getLogger(__name__)

ALIGN = 64  # each tensor's offset in the buffer (any dtype's view of it is aligned)


class Staging:
    """One growable buffer, taken a bucket at a time (`start`, `take`..., `ready`), under `lock`."""

    def __init__(self, pin: bool = True):
        self.pin = pin  # page-lock the buffer for GPU tensors (a CUDA D2H copy then runs at the link's speed)
        self._refused = False  # page-locking was refused: pageable until release()
        self._buf = None  # uint8 torch tensor (None until the first copy)
        self._pinned = False  # whether _buf is page-locked (cudaHostRegister: exactly its size, freed by release)
        self._offset = 0  # bytes of the buffer the current bucket holds
        self._devices: set = set()  # CUDA devices with copies in flight into the current bucket
        self.lock = threading.Lock()  # held while one bucket is packed and put (push.py)

    @property
    def nbytes(self) -> int:
        return 0 if self._buf is None else self._buf.numel()

    def start(self, nbytes: int, cuda: bool, reserve: int = 0) -> None:
        """A new bucket of at most `nbytes` (the previous one's bytes are given up): the buffer
        grows to it (page-locked if `cuda` and pinning is on), and when it grows, to at least
        `reserve` (the push's bucket size) and the alignment of its tensors, so that it grows once
        a push."""
        import torch

        self._offset, self._devices = 0, set()
        pin = self.pin and not self._refused and cuda and torch.cuda.is_available()
        if self._buf is None or self._buf.numel() < nbytes or (pin and not self._pinned):
            size = max(nbytes, self.nbytes, reserve + max(reserve // 64, 64 * ALIGN) if reserve else 0)
            self._drop()
            self._buf = torch.empty(size, dtype=torch.uint8)
            self._pinned = pin and self._register()

    def _register(self) -> bool:
        """Page-locks the buffer (cudaHostRegister: exactly its size; torch's pinned allocator would
        round it up to a power of two and keep it cached after it is freed). Refused, the copies run
        through pageable memory, slower, until release()."""
        import torch

        try:
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(self._buf.data_ptr(), self.nbytes, 0))
            return True
        except (RuntimeError, AssertionError) as e:
            log.warning("staging: page-locking %d bytes refused (%s); staging in pageable memory until release()",
                        self.nbytes, e)
            self._refused = True
            return False

    def take(self, tensor):
        """A copy of `tensor` in the buffer (started copying; `ready` waits for it): its bytes as a
        uint8 numpy array."""
        n = tensor.numel() * tensor.element_size()
        off = self._offset
        if off + n > self.nbytes:
            raise RuntimeError(f"staging: a bucket of {off + n} bytes in a buffer of {self.nbytes} (start() asked less)")
        dst = self._buf[off:off + n]
        if n:
            if tensor.is_cuda:
                self._devices.add(tensor.device)  # (before the copy: a failed one is waited for too)
            dst.view(tensor.dtype).view(tensor.shape).copy_(tensor.detach(), non_blocking=tensor.is_cuda)
        self._offset = off + -(-n // ALIGN) * ALIGN
        return dst.numpy()

    def ready(self) -> None:
        """Every copy into the current bucket done (the CUDA streams that copied, synchronized: a
        D2H copy runs on the current stream of the tensor's device)."""
        import torch

        devices, self._devices = self._devices, set()
        for device in devices:
            torch.cuda.current_stream(device).synchronize()

    def release(self) -> bool:
        """Frees the buffer (unregistered, back to the allocator; the next push allocates it again)
        and lets pinning be tried again. Not while a bucket is packed (returns False then)."""
        if not self.lock.acquire(blocking=False):
            return False
        try:
            self._drop()
            self._refused = False
            return True
        finally:
            self.lock.release()

    def _drop(self) -> None:
        """The buffer let go (a bucket still viewing it keeps its memory, now pageable)."""
        if self._buf is not None and self._pinned:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self._buf.data_ptr())
        self._buf, self._pinned, self._offset = None, False, 0


def one_bucket_at_a_time(staging):
    """The context a bucket is packed and put in: the staging buffer's lock (no lock without one)."""
    return staging.lock if staging is not None else contextlib.nullcontext()


def needs_copy(tensor) -> bool:
    """Whether `pack` must copy the tensor's bytes (it is not a contiguous CPU tensor)."""
    return tensor.device.type != "cpu" or not tensor.is_contiguous()


def bucket_span(sizes: list) -> int:
    """The buffer a bucket of tensors of these byte sizes takes (each offset aligned)."""
    return sum(-(-n // ALIGN) * ALIGN for n in sizes)


_shared = Staging()


def shared() -> Staging:
    """The process's staging buffer: kept from push to push (page-locking a bucket's size costs
    tens of milliseconds), at most the largest bucket pushed. `release()` frees it."""
    return _shared
