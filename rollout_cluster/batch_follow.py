"""One driver batch across router restarts.

The router holds a batch's state in its memory, so a router that restarts loses its batches.
The driver still holds every request: it submits the sequences it has not received to the new
router, and puts their completions back in their place. A sequence is received once; one that
was running when the router went is generated again from its prompt (its partial tokens went
with the router), so it is a fresh sample of the same request, and the output distribution is
unchanged, unless the new router took over what the old one's segments generated: each
resubmitted sequence names its id under the lost router (router_adoption.py). It is asked for
on the weights version the first submission ran on: a new router on
other weights (another driver's update_weights) refuses it, and the batch fails, rather than mix
two policies' samples. Pure bookkeeping: RolloutClient's sync and async loops drive it.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from typing import Optional

from .protocol import BatchLostError, InputError


FINISH_BY = ("sample", "group")


def check_finish_fraction(value, by: str = "sample") -> None:
    if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1):
        raise InputError("finish_fraction", value, "must be null or a number in (0, 1]")
    if by not in FINISH_BY:
        raise InputError("finish_by", by, f"must be one of {', '.join(FINISH_BY)}")


class BatchCut:
    """Where partial rollouts (resume.py) cut a batch: once `fraction` of its samples came back
    (by "sample"), or of its groups, every sample of a prompt (by "group": what GRPO trains on;
    a Partial is a group of its own). The rest are cut off: the batch is cancelled, and they come
    back as "abort" with their tokens so far."""

    def __init__(self, requests: list, fraction: Optional[float], by: str = "sample"):
        check_finish_fraction(fraction, by)
        self.left = Counter(r.prompt_index for r in requests) if by == "group" else None  # prompt -> samples due
        units = len(requests) if self.left is None else len(self.left)
        self.at = None if fraction is None else max(1, math.ceil(fraction * units))
        self.done = 0  # samples, or groups, received whole

    def received(self, request) -> None:
        if self.left is None:
            self.done += 1
            return
        self.left[request.prompt_index] -= 1
        if self.left[request.prompt_index] == 0:
            self.done += 1

    @property
    def reached(self) -> bool:
        return self.at is not None and self.done >= self.at


class BatchAcrossRestarts:
    def __init__(self, requests: list, max_restarts: int = 3, finish_fraction: Optional[float] = None,
                 finish_by: str = "sample"):
        self.cutter = BatchCut(requests, finish_fraction, finish_by)
        self.requests = requests
        self.max_restarts = max_restarts
        self.cut = False  # the current router batch was cancelled at the cutter's mark
        self.results: list = [None] * len(requests)
        self.received = 0
        self.restarts = 0
        self.batch_id = ""
        self.cursor = 0  # how far the current router batch has been fetched
        self.positions = list(range(len(requests)))  # the current router batch's index -> place in `requests`
        self.offset_s = 0.0  # seconds from the first submission to the current one
        self.weights_version = None  # what the first submission ran on: every resubmission asks for it
        self.previous_ids: list = []  # the resubmission's sequence ids under the lost router

    @property
    def done(self) -> bool:
        return self.received == len(self.requests)

    def submitted(self, answer: dict, offset_s: float = 0.0) -> None:
        """The router's answer to a submission: {"batch_id", "weights_version"}."""
        self.batch_id, self.cursor, self.offset_s = answer["batch_id"], 0, offset_s
        self.cut = False  # a resubmission past the cut is cut again at once (should_cut)
        if self.weights_version is None:
            self.weights_version = answer["weights_version"]

    def take(self, new: list, cursor: int) -> list:
        """Place the completions one fetch returned; returns them, placed."""
        placed = []
        for c in new:
            at = self.positions[c.index]
            if self.results[at] is not None:
                raise RuntimeError(f"batch {self.batch_id}: sequence {at} returned twice")
            self.results[at] = c = replace(c, index=at, finish_time_s=c.finish_time_s + self.offset_s)
            self.cutter.received(self.requests[at])
            placed.append(c)
        self.received += len(placed)
        self.cursor = cursor
        return placed

    def should_cut(self) -> bool:
        """finish_fraction reached and the current batch not cut yet: cancel it now."""
        return self.cutter.reached and not self.cut and not self.done

    def timed_out(self, timeout_s: float) -> TimeoutError:
        return TimeoutError(f"batch {self.batch_id}: {self.received} of {len(self.requests)} sequences done after "
                            f"{timeout_s:g} s (timeout_s); the batch was cancelled")

    def on_other_weights(self, lost: BatchLostError, refusal: Exception) -> BatchLostError:
        """The new router holds other weights than the batch ran on: what to raise."""
        return BatchLostError(f"{lost.args[0] if lost.args else lost}; {self.received} of {len(self.requests)} "
                              f"sequences were received on weights version {self.weights_version}, and the rest "
                              f"cannot be generated on the same weights: {refusal}")

    def resubmission(self, lost: BatchLostError) -> list:
        """The requests to submit again after the router lost the current batch."""
        if self.restarts >= self.max_restarts:
            raise BatchLostError(f"{lost.args[0] if lost.args else lost}; {self.received} of {len(self.requests)} "
                                 f"sequences were received, and the rest were submitted again {self.restarts} "
                                 "times already (max_router_restarts)") from lost
        self.restarts += 1
        old_index = {at: j for j, at in enumerate(self.positions)}
        self.positions = [i for i, c in enumerate(self.results) if c is None]
        # what each was called under the lost router: the new one may hold its output so far
        self.previous_ids = [f"{self.batch_id}:{old_index[at]}" for at in self.positions]
        return [self.requests[i] for i in self.positions]
