"""A push's objects at a replica as they come: the trainer sends its order with the manifest and
the first bucket, and the rest as it puts them (push.py), so that the replicas load while it puts.

Every order of a push (LoadWeights, NoteWeights, Wake; resent by the router each time the push
grew) names its objects so far, in order; `offer` adds the ones not seen. The manifest, the first
object, says how many there are (`expect`). A push its trainer aborted is `stop`ped: its reader
fails at once, naming why. A reader waits for the next one (`ref`) at most
`STALL_S` after the last one came: a trainer that hangs mid-push, or one that died without a
lease (the router aborts the push of one that died with it: serve/push_watch.py), or a router
that restarted (it lost the handles), sends no more, and the load fails naming what came
instead of hanging.
`fetched` is the replica's reader: a push's buckets, one fetched ahead of the engine.
"""
from __future__ import annotations

import asyncio
import time
from typing import Optional

from .buckets import Manifest, unpack
from .ipc import unpack_ipc

STALL_S = 60.0  # a push's next object came this long after the one before at most, or the load fails


class BucketsStopped(RuntimeError):
    """The push's objects stopped coming before the last one."""


class BucketStream:
    def __init__(self, source: str, refs=()):
        self.source = source  # the push ("push://<id>")
        self.refs: list = list(refs)  # its objects' handles so far, the manifest first
        self.total: Optional[int] = None  # how many it has (the manifest's buckets + 1), once known
        self.last_t = time.monotonic()  # when the last one came
        self.stopped: Optional[str] = None  # why the push ended before its last object (StopPush), once it did
        self._grew = asyncio.Event()

    def offer(self, refs) -> None:
        """An order's objects: those beyond the ones known are added."""
        refs = tuple(refs or ())
        if len(refs) > len(self.refs):
            self.refs.extend(refs[len(self.refs):])
            self.last_t = time.monotonic()
            self._grew.set()

    def stop(self, reason: str) -> None:
        """The push ended before its last object came (its trainer aborted it): a reader waiting for
        an object, or asking for one later, gets BucketsStopped naming `reason` at once."""
        self.stopped = reason
        self._grew.set()

    def expect(self, total: int) -> None:
        """The manifest says the push has `total` objects; more would be another push's."""
        if len(self.refs) > total:
            raise ValueError(f"{self.source}: {len(self.refs)} objects named, its manifest has {total - 1} buckets")
        self.total = total

    def complete(self) -> bool:
        return self.total is not None and len(self.refs) >= self.total

    async def ref(self, i: int, stall_s: Optional[float] = None):
        """The handle of object `i`, once it came; BucketsStopped after `stall_s` (STALL_S) without one."""
        stall_s = STALL_S if stall_s is None else stall_s
        while self.stopped is None and len(self.refs) <= i:
            left = self.last_t + stall_s - time.monotonic()
            if left <= 0:
                raise BucketsStopped(
                    f"{self.source}: {len(self.refs)} of its {self.total or '?'} objects came, then none for "
                    f"{stall_s:.0f} s (the trainer stopped putting them, or died; or the router that relays them "
                    "restarted): push the weights again")
            self._grew.clear()
            try:
                await asyncio.wait_for(self._grew.wait(), left)
            except asyncio.TimeoutError:
                pass
        if self.stopped is not None:  # (even for an object that came: the load cannot complete)
            raise BucketsStopped(f"{self.source}: stopped after {len(self.refs)} of its {self.total or '?'} objects "
                                 f"came: {self.stopped}")
        return self.refs[i]

    def __len__(self) -> int:
        return len(self.refs)


async def fetched(buckets):
    """The pushed buckets' (name, tensor) lists, fetched from the object store one ahead of the
    engine: the next bucket travels while one loads. (A bucket given as a dict is used as it is.)
    `buckets`: the objects' handles, or a BucketStream of a push whose later objects may still be
    coming (its manifest says how many). However it ends (a fetch failed, the stream stopped, or
    the loader stopped and closed it: a refused bucket, a failed or cancelled load), the fetch
    ahead is cancelled: nothing runs on, or holds a bucket, for a load that is over."""
    stream = buckets if isinstance(buckets, BucketStream) else None
    n = len(buckets) if stream is None else stream.total  # None: known once the manifest came

    async def get(i):
        item = buckets[i] if stream is None else await stream.ref(i)
        return item if isinstance(item, dict) else await item

    i, ahead = 0, asyncio.ensure_future(get(0)) if n is None or n > 0 else None
    try:
        while ahead is not None:
            current, ahead = ahead, asyncio.ensure_future(get(i + 1)) if n is None or i + 1 < n else None
            bucket = await current
            if n is None:  # a stream's first object: its manifest says how many follow
                stream.expect(len(bucket["manifest"]) + 1 if "manifest" in bucket else len(stream))
                n = stream.total
                if ahead is not None and i + 1 >= n:
                    ahead.cancel()
                    ahead = None
            if "manifest" in bucket:  # a push's first object: what every bucket holds, checked before any loads
                yield Manifest(bucket["manifest"])
            else:  # IPC: handles to the trainer's GPU memory
                yield unpack_ipc(bucket) if "ipc" in bucket else unpack(bucket)
            i += 1
    finally:
        if ahead is not None:
            ahead.cancel()
