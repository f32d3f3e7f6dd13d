"""The two drivers of a BatchFollower (follower.py): they make its calls on the router's Serve
handle and sleep when it says so; every decision is the follower's.

`run_sync` blocks (RolloutClient.generate, run_requests, the JSONL runner); `run_async` yields
completions as they come (RolloutClient.stream, and the HTTP Gateway, a deployment of its own
that outlives a router restart). Every call is bounded by call_timeout_s.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator, Callable, Optional

from ..protocol import Completion
from .follower import BatchFollower, Cancel, Done, Fail, Fetch, Pause, Submit

log = logging.getLogger(__name__)
CANCEL_ON_EXIT_S = 10.0  # the most a stopping run_sync waits for its batch's cancel


def run_sync(router, follower: BatchFollower, call_timeout_s: float,
             on_submitted: Optional[Callable[[str], None]] = None, on_restart: Optional[Callable[[], None]] = None,
             on_placed: Optional[Callable[[list], None]] = None) -> list:
    """The batch's completions in input order. `on_submitted(batch_id)` after each submission,
    `on_restart()` before a resubmission after a router restart, `on_placed(completions)` after each fetch.
    A caller that stops before the end (Ctrl-C, an error raised to it) cancels the batch, as
    run_async's does: it would otherwise run for nobody until router.abandoned_batch_s."""
    cancelled: set = set()  # batches a Cancel reached
    try:
        return _run_sync(router, follower, call_timeout_s, on_submitted, on_restart, on_placed, cancelled)
    except BaseException:
        if follower.batch_id and not follower.done and follower.batch_id not in cancelled:
            _cancel_quietly(router, follower.batch_id, min(call_timeout_s, CANCEL_ON_EXIT_S))
        raise


def _cancel_quietly(router, batch_id: str, timeout_s: float) -> None:
    """router.cancel(batch_id) within `timeout_s`; a failure (the batch or the router gone) is logged."""
    try:
        router.cancel.remote(batch_id).result(timeout_s=timeout_s)
    except Exception as e:
        log.warning("could not cancel batch %s: %s", batch_id, e)


def _run_sync(router, follower: BatchFollower, call_timeout_s: float, on_submitted, on_restart, on_placed,
              cancelled: set) -> list:
    while True:
        action = follower.next(time.monotonic())
        if isinstance(action, Done):
            return action.results
        if isinstance(action, Fail):
            raise action.error
        if isinstance(action, Pause):
            time.sleep(action.seconds)
        elif isinstance(action, Submit):
            if action.restart and on_restart is not None:
                on_restart()
            try:
                answer = _submit(router, action).result(timeout_s=follower.submit_timeout_s(action))
            except Exception as e:
                follower.submit_failed(e)
                continue
            follower.submitted(answer, time.monotonic())
            if on_submitted is not None:
                on_submitted(follower.batch_id)
        elif isinstance(action, Fetch):
            try:
                new, cursor, _ = router.fetch.remote(action.batch_id, action.cursor, action.wait_s).result(
                    timeout_s=call_timeout_s)
            except Exception as e:
                follower.fetch_failed(e, time.monotonic(), router_gone(e))
                continue
            placed = follower.take(new, cursor)
            if on_placed is not None:
                on_placed(placed)
        elif isinstance(action, Cancel):
            try:
                router.cancel.remote(action.batch_id).result(timeout_s=call_timeout_s)
            except Exception:
                follower.cancelled(False)
            else:
                cancelled.add(action.batch_id)
                follower.cancelled(True)


async def run_async(router, follower: BatchFollower, call_timeout_s: float,
                    on_restart: Optional[Callable[[], None]] = None) -> AsyncIterator[Completion]:
    """The batch's completions as they finish (not in input order); `on_restart` as run_sync's.
    A caller that stops following before the end (its task cancelled: an HTTP client hung up or
    timed out; or it closed the iterator) cancels the batch, which would otherwise hold replicas
    and live sequences until router.abandoned_batch_s; a submit still under way then runs on, and
    its batch is cancelled once answered."""
    try:
        while True:
            action = follower.next(time.monotonic())
            if isinstance(action, Done):
                return
            if isinstance(action, Fail):
                raise action.error
            if isinstance(action, Pause):
                await asyncio.sleep(action.seconds)
            elif isinstance(action, Submit):
                if action.restart and on_restart is not None:
                    on_restart()
                try:
                    answer = await _submit_async(router, action, follower.submit_timeout_s(action))
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    follower.submit_failed(e)
                    continue
                follower.submitted(answer, time.monotonic())
            elif isinstance(action, Fetch):
                try:
                    new, cursor, _ = await asyncio.wait_for(
                        router.fetch.remote(action.batch_id, action.cursor, action.wait_s), call_timeout_s)
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    follower.fetch_failed(e, time.monotonic(), router_gone(e))
                    continue
                for c in follower.take(new, cursor):
                    yield c
            elif isinstance(action, Cancel):
                try:
                    await asyncio.wait_for(router.cancel.remote(action.batch_id), call_timeout_s)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    follower.cancelled(False)
                else:
                    follower.cancelled(True)
    except (asyncio.CancelledError, GeneratorExit, Exception):  # (the follower's own failure too, as run_sync's)
        if follower.batch_id and not follower.done:
            _cancel_unwaited(router, follower.batch_id)
        raise


async def _submit_async(router, action: Submit, timeout_s: float) -> dict:
    """The submit's answer within `timeout_s`. Past it, or when the caller is cancelled, the call
    runs on (shielded) and the batch it makes is cancelled once it is answered."""
    submitted = asyncio.ensure_future(_submit(router, action))
    try:
        return await asyncio.wait_for(asyncio.shield(submitted), timeout_s)
    except (asyncio.CancelledError, TimeoutError):
        submitted.add_done_callback(lambda f: _cancel_answered(router, f))
        raise


def _cancel_answered(router, submitted) -> None:
    """The batch of a submit answered after its caller gave up: cancelled (a refusal made none)."""
    if not submitted.cancelled() and submitted.exception() is None:
        _cancel_unwaited(router, submitted.result()["batch_id"])


def _cancel_unwaited(router, batch_id: str) -> None:
    """router.cancel(batch_id), not waited for (the caller is being torn down); a failure is logged."""
    def done(task):
        if not task.cancelled() and task.exception() is not None:
            log.warning("cancelling abandoned batch %s failed: %s", batch_id, task.exception())

    try:
        asyncio.ensure_future(router.cancel.remote(batch_id)).add_done_callback(done)
    except Exception as e:  # no event loop left (the process is going): the router drops it when abandoned
        log.warning("could not cancel abandoned batch %s: %s", batch_id, e)


async def follow_batch(router, requests: list, timeout_s: float, call_timeout_s: float = 120.0,
                       max_restarts: int = 3, weights_version: Optional[int] = None,
                       on_restart=None, finish_fraction: Optional[float] = None,
                       finish_by: str = "sample", router_wait_s: Optional[float] = None) -> AsyncIterator[Completion]:
    """Submit `requests` as one batch and yield its completions as they finish. A router restart
    loses the batch: what was not yielded yet is submitted again, on the weights the first
    submission ran on, at most `max_restarts` times. Past `timeout_s` the batch is cancelled and
    TimeoutError raised. RolloutClient.stream and the HTTP Gateway use it. `router_wait_s`: the
    router's router.submit_wait_for_replica_s where the caller knows it (its default otherwise)."""
    follower = BatchFollower(requests, timeout_s, call_timeout_s, max_restarts, weights_version, finish_fraction,
                             finish_by, router_wait_s=router_wait_s)
    async for c in run_async(router, follower, call_timeout_s, on_restart):
        yield c


def _submit(router, action: Submit):
    return router.submit_batch.remote(action.requests, action.wait_for_replica_s, action.weights_version,
                                      action.previous_ids)


def router_absent_errors() -> tuple:
    """The errors of a call that found no router: its process died under the call or is restarting
    (RayActorError: ActorDiedError, ActorUnavailableError), Serve holds no replica of it
    (ReplicaUnavailableError, DeploymentUnavailableError), or the call went unanswered for
    call_timeout_s (TimeoutError: a call to a router killed under it can be). One list for the
    drivers (router_gone) and the Gateway's routes (serve/router_reach.py)."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError

    return (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError, TimeoutError)


def router_gone(error: BaseException) -> bool:
    """A call found no router (router_absent_errors): Serve starts a new one, and the follower waits
    for it, for call_timeout_s at most."""
    return isinstance(error, router_absent_errors())
