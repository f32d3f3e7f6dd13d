"""A push's objects at a replica as they come: the trainer sends its order with the manifest and
the first bucket, and the rest as it puts them (push.py), so that the replicas load while it puts.

Every order of a push (LoadWeights, NoteWeights, Wake; resent by the router each time the push
grew) names its objects so far, in order; `offer` adds the ones not seen. The manifest, the first
object, says how many there are (`expect`). A reader waits for the next one (`ref`) at most
`STALL_S` after the last one came: a trainer that died mid-push, or a router that restarted
(it lost the handles), sends no more, and the load fails naming what came instead of hanging.
"""
from __future__ import annotations

import asyncio
import time
from typing import Optional

STALL_S = 60.0  # a push's next object came this long after the one before at most, or the load fails


class BucketsStopped(RuntimeError):
    """The push's objects stopped coming before the last one."""


class BucketStream:
    def __init__(self, source: str, refs=()):
        self.source = source  # the push ("push://<id>")
        self.refs: list = list(refs)  # its objects' handles so far, the manifest first
        self.total: Optional[int] = None  # how many it has (the manifest's buckets + 1), once known
        self.last_t = time.monotonic()  # when the last one came
        self._grew = asyncio.Event()

    def offer(self, refs) -> None:
        """An order's objects: those beyond the ones known are added."""
        refs = tuple(refs or ())
        if len(refs) > len(self.refs):
            self.refs.extend(refs[len(self.refs):])
            self.last_t = time.monotonic()
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
        while len(self.refs) <= i:
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
        return self.refs[i]

    def __len__(self) -> int:
        return len(self.refs)
