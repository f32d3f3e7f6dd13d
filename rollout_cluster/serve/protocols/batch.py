"""A request's batch on the router: one request is one batch, so its samples are balanced and
migrated across replicas like any other batch; its completions as they finish, the router's
refusals as ProtocolErrors; a request abandoned mid-batch cancels the batch (client/loops.run_async).

What the protocols share is re-exported here: the context and errors (context.py), the body
(json_body.py), prompts and sampling into checked requests (prompts.py), completions as text with
stop strings (outputs.py), the JSON answer (answers.py).
"""
from __future__ import annotations

from typing import AsyncIterator

from ...client.loops import follow_batch
from ...protocol import Completion, LimitExceeded, RouterBusy
# What the protocols share, re-exported here (each lives in its own file)
from .answers import Answer, answer, dumps  # noqa: F401
from .context import ProtocolContext, ProtocolError  # noqa: F401
from .json_body import SURROGATE, read_json  # noqa: F401
from .outputs import MAX_STOP_STRINGS, Output, output_of, stop_list  # noqa: F401
from .prompts import chat_prompt, checked_requests, prompt_ids, spec_of  # noqa: F401



async def stream_batch(ctx: ProtocolContext, requests: list) -> AsyncIterator[Completion]:
    """The batch's completions as they finish; the router's refusals as ProtocolErrors."""
    try:
        async for c in follow_batch(ctx.router, requests, ctx.batch_timeout_s, ctx.call_timeout_s):
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
