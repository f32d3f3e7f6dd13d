"""One driver batch, followed to its end: the sans-I/O follower.

It decides every protocol step of a batch (submit, fetch, resubmit after a router restart, cut at
finish_fraction, cancel past timeout_s) and does none: `next(now)` returns the action, and the
answer or error of each call comes back through one event method. No Ray, no asyncio, no clock:
the time is an argument. The sync driver (RolloutClient.generate, the JSONL runner) and the async
one (stream, the HTTP Gateway) in loops.py only make the calls.

Across router restarts: the router holds a batch's state in its memory, so a router that restarts
loses its batches. The driver still holds every request: it submits the sequences it has not
received to the new router, and puts their completions back in their place. A sequence is
received once; one that was running when the router went is generated again from its prompt
(its partial tokens went with the router), so it is a fresh sample of the same request, unless
the new router took over what the old one's segments generated: each resubmitted sequence names
its id under the lost router (router_adoption.py). It is asked for on the weights version the
first submission ran on: a new router on other weights (another driver's update_weights)
refuses it, and the batch fails, rather than mix two policies' samples.
"""
from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, replace
from typing import Optional, Union

from ..config import RouterConfig
from ..protocol import BatchLostError, InputError, WeightsVersionError, check_wait_s, is_number

log = logging.getLogger(__name__)
FINISH_BY = ("sample", "group")
DEFAULT_TIMEOUT_S = 3600.0
FETCH_WAIT_S = 1.0  # a fetch's long-poll at the router
GONE_PAUSE_S = 0.5  # between fetches while Serve replaces a router that died
# how long a router waits for a live replica when a submit names no wait (its config's default)
ROUTER_SUBMIT_WAIT_S = RouterConfig.model_fields["submit_wait_for_replica_s"].default


# ---- actions: what the driver does next ----------------------------------------------------
@dataclass(frozen=True)
class Submit:
    """router.submit_batch(requests, wait_for_replica_s, weights_version, previous_ids); answer: submitted()."""
    requests: list
    wait_for_replica_s: Optional[float]
    weights_version: Optional[int]  # the caller's pin first; then the version the first submission ran on
    previous_ids: Optional[list]  # None first; then each sequence's id under the lost router
    restart: bool = False  # a resubmission after a router restart (the client counts them)


@dataclass(frozen=True)
class Fetch:
    """router.fetch(batch_id, cursor, wait_s); answer: take(), error: fetch_failed()."""
    batch_id: str
    cursor: int
    wait_s: float = FETCH_WAIT_S


@dataclass(frozen=True)
class Cancel:
    """router.cancel(batch_id); then cancelled(ok). `why`: "cut" (finish_fraction reached) or
    "timeout" (timeout_s passed: the batch fails after it, whether the cancel worked or not)."""
    batch_id: str
    why: str


@dataclass(frozen=True)
class Pause:
    seconds: float


@dataclass(frozen=True)
class Done:
    results: list  # one Completion per request, in place


@dataclass(frozen=True)
class Fail:
    error: BaseException  # raise it


Action = Union[Submit, Fetch, Cancel, Pause, Done, Fail]


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
        # (rounded first: 0.55 * 100 is 55.00000000000001 in floating point, and ceil made it 56)
        self.at = None if fraction is None else max(1, math.ceil(round(fraction * units, 9)))
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


def _caused(error: BaseException, cause: BaseException) -> BaseException:
    """`error` as `raise error from cause` would raise it."""
    error.__cause__, error.__suppress_context__ = cause, True
    return error


class BatchFollower:
    """Events in: submitted, submit_failed, take, fetch_failed, cancelled. Actions out: next(now)."""

    def __init__(self, requests: list, timeout_s: float = DEFAULT_TIMEOUT_S, call_timeout_s: float = 120.0,
                 max_restarts: int = 3, weights_version: Optional[int] = None,
                 finish_fraction: Optional[float] = None, finish_by: str = "sample",
                 wait_for_replica_s: Optional[float] = None, router_wait_s: Optional[float] = None):
        if not (is_number(timeout_s) and math.isfinite(timeout_s) and timeout_s > 0):
            raise InputError("timeout_s", timeout_s, "must be a finite number of seconds > 0")
        check_wait_s("wait_for_replica_s", wait_for_replica_s)
        self.cutter = BatchCut(requests, finish_fraction, finish_by)
        self.requests = requests
        self.timeout_s, self.call_timeout_s, self.max_restarts = timeout_s, call_timeout_s, max_restarts
        self.asked_version = weights_version
        # the router's router.submit_wait_for_replica_s, as far as known (None: its default)
        self.router_wait_s = ROUTER_SUBMIT_WAIT_S if router_wait_s is None else router_wait_s
        # how long a submit lets the router wait for a live replica: the caller's, else no longer than
        # the batch may take (timeout_s), which the router's own default (600 s) would outlast
        self.wait_for_replica_s = (wait_for_replica_s if wait_for_replica_s is not None
                                   else timeout_s if timeout_s < self.router_wait_s else None)
        self.results: list = [None] * len(requests)
        self.received = 0
        self.restarts = 0
        self.t0: Optional[float] = None  # when the first submission was asked for
        self.batch_id = ""  # the current router batch
        self.cursor = 0  # how far the current router batch has been fetched
        self.positions = list(range(len(requests)))  # the current router batch's index -> place in `requests`
        self.offset_s = 0.0  # seconds from the first submission to the current one
        self.weights_version = None  # what the first submission ran on: every resubmission asks for it
        self.previous_ids: list = []  # the resubmission's sequence ids under the lost router
        self.cut = False  # the current router batch was cancelled at the cutter's mark
        self.fetched = False  # a fetch answered since the last action: the moment to look at the cut
        self.lost: Optional[BatchLostError] = None  # why the submission under way is a resubmission
        self.gone_since: Optional[float] = None  # when fetches started failing because the router died
        self.pending: Optional[Action] = None  # decided by an event, returned by the next next()
        # every completion received, and the router told so by a fetch from the batch's end (which
        # releases it: it keeps a batch fetched whole for a retry of the last fetch, whose answer may be lost)
        self.acknowledged = False

    @property
    def done(self) -> bool:
        return self.received == len(self.requests)

    def next(self, now: float) -> Action:
        """What to do now."""
        if self.pending is not None:
            action, self.pending = self.pending, None
            return action
        if not self.requests:  # nothing to generate: no batch (the router would hold it unfetched)
            return Done([])
        if self.t0 is None and not self.batch_id:
            self.t0 = now
            return Submit(self.requests, self.wait_for_replica_s, self.asked_version, None)
        if self.done:
            if self.acknowledged or not self.batch_id:
                return Done(self.results)
            self.acknowledged = True  # once: a failure leaves it to router.finished_batch_keep_s
            return Fetch(self.batch_id, self.cursor, 0.0)
        fetched, self.fetched = self.fetched, False
        if fetched and self.should_cut():  # a cancel that failed is tried again after the next fetch
            return Cancel(self.batch_id, "cut")
        if now > (self.t0 or 0.0) + self.timeout_s:
            self.pending = Fail(self.timed_out())
            return Cancel(self.batch_id, "timeout")
        return Fetch(self.batch_id, self.cursor)

    # ---- events: what the router answered ----------------------------------------------------
    def submitted(self, answer: dict, now: float = 0.0) -> None:
        """A submission's answer: {"batch_id", "weights_version"}."""
        if self.t0 is None:
            self.t0 = now
        self.offset_s = now - self.t0 if self.batch_id else 0.0
        self.batch_id, self.cursor, self.lost = answer["batch_id"], 0, None
        self.gone_since = None  # (a router answered: a later death is timed from its own start)
        self.cut = False  # a resubmission past the cut is cut again after its first fetch
        if self.weights_version is None:
            self.weights_version = answer["weights_version"]

    def submit_failed(self, error: BaseException) -> None:
        """A submission raised. A resubmission that a fleet on other weights refused fails the
        batch saying how much came back on which version; anything else is raised as it is."""
        if self.lost is not None and isinstance(error, WeightsVersionError):
            error = _caused(BatchLostError(
                f"{_said(self.lost)}; {self.received} of {len(self.requests)} sequences were received on weights "
                f"version {self.weights_version}, and the rest cannot be generated on the same weights: {error}"), error)
        self.pending = Fail(error)

    def take(self, new: list, cursor: int) -> list:
        """A fetch's answer: place its completions; returns them, placed."""
        placed = []
        for c in new:
            at = self.positions[c.index]
            if self.results[at] is not None:
                raise RuntimeError(f"batch {self.batch_id}: sequence {at} returned twice")
            self.results[at] = c = replace(c, index=at, finish_time_s=c.finish_time_s + self.offset_s)
            self.cutter.received(self.requests[at])
            placed.append(c)
        self.received += len(placed)
        self.cursor, self.fetched, self.gone_since = cursor, True, None
        return placed

    def fetch_failed(self, error: BaseException, now: float, router_gone: bool = False) -> None:
        """A fetch raised. BatchLostError: a new router lost the batch, so what was not received is
        submitted again. `router_gone` (the router's process died under the call, or the call went
        unanswered for call_timeout_s): Serve starts a new router, which answers a later fetch with
        BatchLostError; fetching again is safe (a fetch only reads), for call_timeout_s more at
        most. Anything else is raised. The final fetch from the end of a batch received whole
        cannot fail it: the router drops that batch after router.finished_batch_keep_s anyway."""
        if self.done:
            return
        if isinstance(error, BatchLostError):
            self.gone_since = None  # (a new router answered)
            self.pending = self._resubmission(error)
        elif not router_gone:
            self.pending = Fail(error)
        elif self.gone_since is not None and now - self.gone_since > self.call_timeout_s:
            self.pending = Fail(_caused(TimeoutError(
                f"the router has not answered for {now - self.gone_since:.0f} s since it died "
                f"(call_timeout_s={self.call_timeout_s:g}): {error}"), error))
        else:
            if self.gone_since is None:
                log.warning("the router died under a fetch (%r); waiting for Serve's new one", error)
                self.gone_since = now
            self.pending = Pause(GONE_PAUSE_S)

    def cancelled(self, ok: bool) -> None:
        """A Cancel's outcome (False: it raised; the next fetch finds out what happened to the router)."""
        if not isinstance(self.pending, Fail):  # a timeout's cancel: the batch fails either way
            self.cut = ok

    # ---- decisions ----------------------------------------------------------------------------
    def submit_timeout_s(self, action: Submit) -> float:
        """How long a driver waits for a submission's answer: a call's bound plus the router's wait
        for a live replica (the submit's own, else the router's router.submit_wait_for_replica_s).
        A shorter wait would give up on a batch the router then makes for nobody."""
        wait = self.router_wait_s if action.wait_for_replica_s is None else action.wait_for_replica_s
        return self.call_timeout_s + wait

    def should_cut(self) -> bool:
        """finish_fraction reached and the current batch not cut yet: cancel it now."""
        return self.cutter.reached and not self.cut and not self.done

    def timed_out(self) -> TimeoutError:
        return TimeoutError(f"batch {self.batch_id}: {self.received} of {len(self.requests)} sequences done after "
                            f"{self.timeout_s:g} s (timeout_s); the batch was cancelled")

    def _resubmission(self, lost: BatchLostError) -> Action:
        """What to submit again after the router lost the current batch, or the failure past max_restarts."""
        if self.restarts >= self.max_restarts:
            return Fail(_caused(BatchLostError(
                f"{_said(lost)}; {self.received} of {len(self.requests)} sequences were received, and the rest were "
                f"submitted again {self.restarts} times already (max_router_restarts)"), lost))
        self.restarts += 1
        self.lost = lost
        old_index = {at: j for j, at in enumerate(self.positions)}
        self.positions = [i for i, c in enumerate(self.results) if c is None]
        # what each was called under the lost router: the new one may hold its output so far
        self.previous_ids = [f"{self.batch_id}:{old_index[at]}" for at in self.positions]
        log.warning("%s; submitting the %d sequences not received again (%d of %d received)",
                    _said(lost), len(self.positions), self.received, len(self.requests))
        return Submit([self.requests[i] for i in self.positions], self.wait_for_replica_s, self.weights_version,
                      self.previous_ids, restart=True)


def _said(error: BaseException) -> str:
    return str(error.args[0]) if error.args else str(error)
