"""A request's batch on the router: one request is one batch, so its samples are balanced and
migrated across replicas like any other batch; its completions as they finish, the router's
refusals as ProtocolErrors, and a request abandoned mid-batch cancels the batch.

What the protocols share is re-exported here: the context and errors (context.py), the body
(json_body.py), prompts and sampling into checked requests (prompts.py), completions as text with
stop strings (outputs.py), the JSON answer (answers.py).
"""
from __future__ import annotations

import asyncio
import logging
from typing import AsyncIterator

from ...client.loops import follow_batch
from ...protocol import Completion, LimitExceeded, RouterBusy
# What the protocols share, re-exported here (each lives in its own file)
from .answers import Answer, answer, dumps  # noqa: F401
from .context import ProtocolContext, ProtocolError  # noqa: F401
from .json_body import SURROGATE, read_json  # noqa: F401
from .outputs import MAX_STOP_STRINGS, Output, output_of, stop_list  # noqa: F401
from .prompts import chat_prompt, checked_requests, prompt_ids, spec_of  # noqa: F401

log = logging.getLogger("ray.serve")


class _Noting:
    """`router` as follow_batch calls it, each batch it submits noted in `ids`. A submit whose
    caller is cancelled before the answer came (the request abandoned, or the submit's timeout)
    runs on, shielded, and the batch it made is cancelled once its id is known."""

    def __init__(self, router, ids: list):
        self.router, self.ids = router, ids

    def __getattr__(self, name: str):
        return getattr(self.router, name)

    @property
    def submit_batch(self):
        router, ids = self.router, self.ids

        class Noted:
            @staticmethod
            def remote(*args, **kwargs):
                async def call():
                    submitted = asyncio.ensure_future(router.submit_batch.remote(*args, **kwargs))
                    try:
                        answer = await asyncio.shield(submitted)
                    except asyncio.CancelledError:
                        submitted.add_done_callback(lambda f: _cancel_answered(router, f))
                        raise
                    ids.append(answer["batch_id"])
                    return answer
                return call()
        return Noted


async def follow_request(router, requests: list, *args, **kwargs) -> AsyncIterator[Completion]:
    """follow_batch for an HTTP request: one abandoned mid-batch (Serve cancels its task when the
    client hangs up or times out, and the openai package then retries) cancels the batch it left
    running, which otherwise held replicas and max_live_sequences until router.abandoned_batch_s."""
    ids: list = []
    finished = False
    try:
        async for c in follow_batch(_Noting(router, ids), requests, *args, **kwargs):
            yield c
        finished = True
    except (asyncio.CancelledError, GeneratorExit):
        if ids and not finished:
            _cancel_later(router, ids[-1])
        raise


def _cancel_answered(router, submitted) -> None:
    """The batch of a submit answered after its caller gave up: cancelled (a refusal made none)."""
    if not submitted.cancelled() and submitted.exception() is None:
        _cancel_later(router, submitted.result()["batch_id"])


def _cancel_later(router, batch_id: str) -> None:
    """router.cancel(batch_id), not waited for (the request is being torn down); its failure is logged."""
    def done(task):
        if not task.cancelled() and task.exception() is not None:
            log.warning("gateway: cancelling abandoned batch %s failed: %s", batch_id, task.exception())

    try:
        asyncio.ensure_future(router.cancel.remote(batch_id)).add_done_callback(done)
    except Exception as e:  # no event loop left (the process is going): the router drops it when abandoned
        log.warning("gateway: could not cancel abandoned batch %s: %s", batch_id, e)


async def stream_batch(ctx: ProtocolContext, requests: list) -> AsyncIterator[Completion]:
    """The batch's completions as they finish; the router's refusals as ProtocolErrors."""
    try:
        async for c in follow_request(ctx.router, requests, ctx.batch_timeout_s, ctx.call_timeout_s):
            if c.error:
                raise ProtocolError(400, c.error)
            yield c
    except RouterBusy as e:  # 503 + Retry-After: the clients these routes serve retry it (TRL does not retry 429)
        raise ProtocolError(503, str(e), kind="ServiceUnavailableError", retry_after_s=ctx.limits.retry_after_s) from None
    except LimitExceeded as e:
        raise ProtocolError(400, str(e)) from None
    except TimeoutError as e:
        raise ProtocolError(504, str(e), kind="TimeoutError") from None
    except ProtocolError:
        raise
    except Exception as e:  # no live replica, a lost batch: say why; nothing of it comes back
        raise ProtocolError(503, f"{type(e).__name__}: {e}", kind="ServiceUnavailableError",
                            retry_after_s=ctx.limits.retry_after_s) from None


async def run_batch(ctx: ProtocolContext, requests: list) -> list[Completion]:
    """Every completion of the batch, in request order (prompt-major)."""
    results: list = [None] * len(requests)
    async for c in stream_batch(ctx, requests):
        results[c.index] = c
    return results
