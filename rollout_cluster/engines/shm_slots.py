"""Reusable /dev/shm buffers between a replica and its vLLM worker: the buckets' one copy lands in
memory both processes have mapped already.

A fresh /dev/shm file per bucket costs a page fault per 4 KiB twice (the replica's write, the
worker's map), and on a VM each fault is slow: writing 256 MiB into fresh memory took 1.26 s here
against 0.07 s into memory touched before (experiments/weights-sync/README.md). So a replica keeps
a few slots: each is a /dev/shm file of fixed size, allocated whole up front (posix_fallocate: a
/dev/shm too small refuses here instead of killing the process later with SIGBUS) and mapped by
the replica. The worker maps a slot at its first load (by path) and keeps the mapping under the
slot's id; once it has, the replica unlinks the file, so nothing is left in /dev/shm if either
process dies. Two slots suffice: one the worker loads while the replica writes the next.
"""
from __future__ import annotations

import mmap
import os
import threading
import uuid

MAX_FREE = 2  # slots kept beyond the ones in use (a bucket larger than each makes a new one)


class Slot:
    def __init__(self, nbytes: int, directory: str):
        import torch

        self.id = uuid.uuid4().hex[:12]
        self.nbytes = nbytes  # the file's size
        self.path = os.path.join(directory, f"rollout-slot-{os.getpid()}-{self.id}")
        self.shared = False  # the worker has mapped it (the file is unlinked then)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)
            self._mm = mmap.mmap(fd, nbytes)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.buf = torch.frombuffer(self._mm, dtype=torch.uint8)  # writable, shared with the worker

    def write(self, offsets: list, flats: list) -> None:
        """The bucket's tensors (flat uint8) into the slot at their offsets: the one copy."""
        for off, flat in zip(offsets, flats):
            if flat.numel():
                self.buf[off:off + flat.numel()].copy_(flat.cpu())

    def worker_has_it(self) -> None:
        if not self.shared:
            self.shared = True
            self._unlink()

    def _unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        self._unlink()
        self.buf = None
        try:
            self._mm.close()
        except BufferError:  # a view still exists; the mapping goes with it
            pass


class Slots:
    """A replica's slots for one engine."""

    def __init__(self, directory: str):
        self.directory = directory
        self.free: list[Slot] = []  # slots no load uses now
        self.used: dict[str, Slot] = {}  # id -> slot being written or loaded
        # take() runs in staging threads, give() on the event loop: the pool changes under one lock
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> Slot:
        with self._lock:
            fits = sorted((s for s in self.free if s.nbytes >= nbytes), key=lambda s: s.nbytes)
            slot = fits[0] if fits else None
            if slot is not None:
                self.free.remove(slot)
        if slot is None:
            slot = Slot(max(nbytes, 1), self.directory)  # (a new file: made outside the lock)
        with self._lock:
            self.used[slot.id] = slot
        return slot

    def give(self, slot: Slot, ok: bool) -> None:
        """Back to the pool after the worker loaded it; after a failure it is dropped, and so is
        one the worker never mapped (a load that failed before sending it): its file is still in
        /dev/shm, and a pool nobody closes (a broken engine's replica restarts) would leave it."""
        evicted = []
        with self._lock:
            self.used.pop(slot.id, None)
            if ok and slot.shared:
                self.free.append(slot)
                while len(self.free) > MAX_FREE:
                    small = min(self.free, key=lambda s: s.nbytes)
                    self.free.remove(small)
                    evicted.append(small)
            else:
                evicted.append(slot)
        for s in evicted:
            s.close()

    def ids(self) -> list:
        """The slots the worker may keep mapped."""
        with self._lock:
            return [s.id for s in self.free] + list(self.used)

    def close(self) -> None:
        for s in self.free + list(self.used.values()):
            s.close()
        self.free, self.used = [], {}
