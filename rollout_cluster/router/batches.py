"""The batches a router holds: their results in finishing order, who fetched them last, and why
a batch that is gone went.

A batch lives in the router's memory from `submit` until its driver fetched it whole and said so
(a fetch with its cursor at the batch's end: `fetch` releases it), or abandoned it. A batch whose
whole answer went out is kept `router.finished_batch_keep_s` for a retry of that fetch (its answer
may be lost on the way: the driver's call timed out), then dropped (`drop_finished`). A batch
nobody fetches is dropped after `router.abandoned_batch_s` (its trainer died), or after
CANCELLED_UNFETCHED_S once cancelled (its driver timed out). A fetch of a batch that is gone says
which of these happened, or that another router made it (the router restarted, and its batches
went with it: BatchLostError, which the driver answers by submitting again).

Plain bookkeeping: no clock, no I/O. RouterCore cancels a dropped batch's sequences.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..protocol import BatchLostError, Completion, InputError, is_int
from .state import GroupState

DROPPED_KEPT = 1024  # abandoned batches remembered, to tell a late fetch why its batch is gone
BATCH_ID = re.compile(r"^(.+?-)b\d+(?:-[0-9a-f]{16})?$")  # "<router's id prefix>b<n>[-<salt>]": which router made it
CANCELLED_UNFETCHED_S = 60.0  # a cancelled batch (driver timed out) not fetched for this long is dropped


@dataclass
class BatchState:
    batch_id: str
    size: int  # sequences submitted
    submitted_t: float
    results: list[Optional[Completion]]  # by index in the batch; None until it finishes
    order: list[int] = field(default_factory=list)  # indices in finishing order: a fetch cursor counts these
    weights_version: int = 0  # the version the batch runs on (every segment's)
    pinned: bool = False  # its driver named that version (submit(weights_version=v)): it runs on it or fails
    fetched_t: float = 0.0  # the latest fetch (or the submission): the abandonment clock
    cancelled: bool = False  # cancel() was called: the driver may fetch the aborts, or be gone
    # when a fetch first answered it whole; it is kept for a retry of that answer (which may have
    # been lost) until the driver's fetch from the end, or router.finished_batch_keep_s (None: not yet)
    answered_done_t: Optional[float] = None

    @property
    def done(self) -> bool:
        return len(self.order) == self.size


class Batches:
    def __init__(self, id_prefix: str = "", id_salt: Optional[Callable[[], str]] = None):
        # Batch ids are "<id_prefix>b<n>", and "<id_prefix>b<n>-<salt>" with `id_salt` (16 hex
        # digits). The Serve router passes its own id: after a restart, replicas may still run the
        # old router's sequences, whose ids must not match new ones; and a random salt, since any
        # caller who knows a batch's id can fetch it.
        self.id_prefix = id_prefix
        self.id_salt = id_salt
        self.live: dict[str, BatchState] = {}  # batch_id -> state, until released or dropped
        self.dropped: dict[str, str] = {}  # batch_id -> why it was dropped unfetched (bounded, in order)
        # (batch_id, prompt_index) -> the group of a prompt's samples, whose lengths correlate: the
        # policy reads how many finished and how long they were
        self.groups: dict[tuple[str, int], GroupState] = {}
        self._next = 0

    def __getitem__(self, batch_id: str) -> BatchState:
        return self.live[batch_id]

    def __contains__(self, batch_id) -> bool:
        return batch_id in self.live

    def __len__(self) -> int:
        return len(self.live)

    def __iter__(self):
        return iter(self.live)

    def values(self):
        return self.live.values()

    def get(self, batch_id: str) -> Optional[BatchState]:
        return self.live.get(batch_id)

    def open(self, size: int, now: float, weights_version: int, batch_id: Optional[str] = None) -> BatchState:
        """A new batch of `size` sequences (its id made here unless given)."""
        if batch_id is None:
            batch_id = f"{self.id_prefix}b{self._next}" + (f"-{self.id_salt()}" if self.id_salt else "")
            self._next += 1
        batch = BatchState(batch_id, size, now, [None] * size, weights_version=weights_version, fetched_t=now)
        self.live[batch_id] = batch
        return batch

    def open_groups(self, batch_id: str, prompt_indices: list[int]) -> None:
        """One group per prompt of the batch, sized by its samples."""
        sizes: dict = {}
        for i in prompt_indices:
            sizes[(batch_id, i)] = sizes.get((batch_id, i), 0) + 1
        for key, size in sizes.items():
            self.groups[key] = GroupState(size=size)

    def group_finished(self, group: tuple, length: int, counts_length: bool) -> None:
        """A sample of `group` ended after `length` tokens (an error's length is not evidence)."""
        g = self.groups.get(group)
        if g is None:
            return
        g.finished += 1
        if counts_length:
            g.finished_len_max = max(g.finished_len_max, length)
            g.finished_len_sum += length

    def _forget_groups(self, batch_id: str) -> None:
        for key in [k for k in self.groups if k[0] == batch_id]:
            del self.groups[key]

    def record(self, batch_id: str, index: int, done: Completion) -> None:
        """A sequence of the batch finished (a batch already gone ignores it)."""
        batch = self.live.get(batch_id)
        if batch is not None:
            batch.results[index] = done
            batch.order.append(index)

    def fetch(self, batch_id: str, cursor: int, now: Optional[float] = None) -> tuple[list[Completion], int, bool]:
        """(completions finished since `cursor`, new cursor, batch done); a batch that is gone
        raises KeyError (BatchLostError if another router made it) saying why. Idempotent: a retry
        from the same cursor gets the same completions, the last fetch's too (the batch is kept
        after its whole answer went out); a fetch from the end of a finished batch says the driver
        holds every completion, and releases it."""
        batch = self.live.get(batch_id)
        if batch is None:
            raise self._gone(batch_id)
        if not is_int(cursor) or not 0 <= cursor <= len(batch.order):  # (-1 or None would hand completions out again)
            raise InputError("cursor", cursor, f"must be an integer from 0 to {len(batch.order)} (the batch's "
                             "completions so far): the cursor the last fetch returned")
        if now is not None:
            batch.fetched_t = now
        if batch.done and cursor >= batch.size:
            self.release(batch_id)
            return [], batch.size, True
        new = [batch.results[i].with_lists() for i in batch.order[cursor:]]
        if batch.done and batch.answered_done_t is None:
            batch.answered_done_t = batch.fetched_t
        return new, len(batch.order), batch.done

    def _gone(self, batch_id) -> KeyError:
        if batch_id in self.dropped:
            return KeyError(f"batch_id={batch_id!r}: {self.dropped[batch_id]}")
        made_by = BATCH_ID.match(batch_id) if isinstance(batch_id, str) else None
        if self.id_prefix and made_by and made_by.group(1) != self.id_prefix:
            return BatchLostError(f"batch_id={batch_id!r}: made by another router, not this one "
                                  f"({self.id_prefix}...): the router restarted, and its batches were lost with it")
        return KeyError(f"batch_id={batch_id!r}: unknown batch (finished and collected, or never submitted)")

    def abandoned(self, now: float, idle_s: float) -> list[str]:
        """Batches nobody fetched from for `idle_s` (CANCELLED_UNFETCHED_S if that is shorter and
        the batch was cancelled). 0: never."""
        if idle_s <= 0:
            return []
        cancelled_s = min(idle_s, CANCELLED_UNFETCHED_S)
        return [bid for bid, b in self.live.items() if now - b.fetched_t > (cancelled_s if b.cancelled else idle_s)]

    def drop(self, batch_id: str, now: float, idle_s: float) -> None:
        """Forget a batch abandoned after `idle_s` (router.abandoned_batch_s), remembering why for
        a late fetch (after its cancel), with the wait that applied to it."""
        batch = self.live.pop(batch_id)
        limit = (f"cancelled, and {CANCELLED_UNFETCHED_S:.0f} s is the wait for a cancelled batch"
                 if batch.cancelled and CANCELLED_UNFETCHED_S < idle_s else f"router.abandoned_batch_s={idle_s:g}")
        self.dropped[batch_id] = (f"dropped {now - batch.submitted_t:.0f} s after submission: no fetch for "
                                  f"{now - batch.fetched_t:.0f} s ({limit}); {len(batch.order)} of {batch.size} "
                                  "sequences had finished")
        while len(self.dropped) > DROPPED_KEPT:
            del self.dropped[next(iter(self.dropped))]
        self._forget_groups(batch_id)

    def finished_unacknowledged(self, now: float, keep_s: float) -> list[str]:
        """Batches whose whole answer went out more than `keep_s` ago with no fetch from their end
        since (the driver got the answer and stopped, or died)."""
        return [bid for bid, b in self.live.items()
                if b.answered_done_t is not None and now - b.answered_done_t > keep_s]

    def drop_finished(self, batch_id: str, now: float) -> None:
        """Forget a batch fetched whole and kept past router.finished_batch_keep_s, remembering why."""
        batch = self.live[batch_id]
        self.release(batch_id)
        self.dropped[batch_id] = (f"fetched whole {now - batch.answered_done_t:.0f} s ago, and kept "
                                  "router.finished_batch_keep_s for a retry of that fetch")
        while len(self.dropped) > DROPPED_KEPT:
            del self.dropped[next(iter(self.dropped))]

    def release(self, batch_id: str) -> bool:
        """Forget a batch its driver fetched whole; returns whether it was held."""
        if self.live.pop(batch_id, None) is None:
            return False
        self._forget_groups(batch_id)
        return True

    def status(self, now: float) -> dict:
        """batch_id -> size, finished, seconds since submission and since the latest fetch."""
        return {bid: {"size": b.size, "finished": len(b.order), "age_s": round(now - b.submitted_t, 1),
                      "unfetched_s": round(now - b.fetched_t, 1)} for bid, b in self.live.items()}
