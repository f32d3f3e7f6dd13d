"""The parts of an OpenAI-compatible answer: errors in OpenAI's shape, logprobs, usage, and a
stream that answers once its first choice came."""
from __future__ import annotations

from itertools import accumulate
from typing import AsyncIterator, Optional

from fastapi.responses import JSONResponse

from .context import ProtocolContext, ProtocolError


def error(e: ProtocolError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s else None
    return JSONResponse({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status}},
                        status_code=e.status, headers=headers)


def sampled_logprobs(value: Optional[int], param: str) -> Optional[int]:
    if value is None:
        return None
    if value != 0:
        raise ProtocolError(400, f"{param}={value}: only the sampled token's logprob is available ({param}=0)", param)
    return 0


def _token_strings(ctx: ProtocolContext, ids: list, as_ids: bool) -> list:
    if as_ids or ctx.codec is None:
        return [f"token_id:{t}" for t in ids]
    return ctx.token_texts(ids)


def completion_logprobs(ctx: ProtocolContext, out, as_ids: bool, offset: int = 0) -> dict:
    tokens = _token_strings(ctx, out.token_ids, as_ids)
    lps = [-9999.0 if lp < -9999.0 else lp for lp in out.logprobs]  # max(lp, -9999.0), NaN kept
    offsets = list(accumulate(map(len, tokens), initial=offset))[:-1]
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens,
            "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, lps)]}


def chat_logprobs(ctx: ProtocolContext, out, as_ids: bool) -> dict:
    tokens = _token_strings(ctx, out.token_ids, as_ids)
    return {"content": [{"token": tok, "logprob": max(lp, -9999.0), "bytes": list(tok.encode("utf-8")),
                         "top_logprobs": []} for tok, lp in zip(tokens, out.logprobs)]}


def usage(prompts: list, outputs: list) -> dict:
    p, c = sum(len(x) for x in prompts), sum(len(o.token_ids) for o in outputs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c, "prompt_tokens_details": None}


def last_usage(prompts: list, outputs: list) -> dict:
    """A stream's usage chunk: the whole request's usage, without its null fields (vLLM dumps that
    chunk with exclude_none)."""
    return {k: v for k, v in usage(prompts, outputs).items() if v is not None}


def chunk_usage(prompt: list, out, chat: bool) -> dict:
    """The usage on one choice's chunk (stream_options.continuous_usage_stats): its prompt's tokens and
    the choice's tokens so far (the whole choice: a stream sends each choice once, done). vLLM's chat
    chunks set completion_tokens_details (null without a reasoning parser), its completion chunks do not."""
    p, c = len(prompt), len(out.token_ids)
    return {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c,
            **({"completion_tokens_details": None} if chat else {})}


async def started(completions: AsyncIterator) -> AsyncIterator:
    """`completions` once its first one came: a stream sends each choice whole, so nothing is lost
    by answering then, and a refusal before it (a full router: 503 with Retry-After; a timeout; no
    replica) is answered with its status, not as an event after a 200."""
    first = await completions.__anext__()

    async def chained():
        yield first
        async for c in completions:
            yield c
    return chained()
