"""The parts of an OpenAI-compatible answer: errors in OpenAI's shape, logprobs, usage, and a
stream of server-sent events that answers once its first choice came."""
from __future__ import annotations

from itertools import accumulate
from typing import AsyncIterator, Callable, Optional, Sequence

from fastapi.responses import JSONResponse, StreamingResponse

from .answers import dumps
from .context import ProtocolContext, ProtocolError


def error_body(e: ProtocolError) -> dict:
    return {"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status}}


def error(e: ProtocolError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s else None
    return JSONResponse(error_body(e), status_code=e.status, headers=headers)


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
    """`bytes`: the token's text's, as vLLM's (its decoded token's, "token_id:N" or not; null without
    a tokenizer)."""
    texts = ctx.token_texts(out.token_ids) if ctx.codec is not None else None
    tokens = [f"token_id:{t}" for t in out.token_ids] if as_ids or texts is None else texts
    return {"content": [{"token": tok, "logprob": max(lp, -9999.0),
                         "bytes": list(texts[k].encode("utf-8", errors="replace")) if texts is not None else None,
                         "top_logprobs": []} for k, (tok, lp) in enumerate(zip(tokens, out.logprobs))]}


def usage(prompts: list, outputs: list) -> dict:
    p, c = sum(len(x) for x in prompts), sum(len(o.token_ids) for o in outputs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c, "prompt_tokens_details": None}


def last_usage(prompts: list, outputs: list) -> dict:
    """A stream's usage chunk: the whole request's usage, without its null fields (vLLM dumps that
    chunk with exclude_none)."""
    return {k: v for k, v in usage(prompts, outputs).items() if v is not None}


def chunk_usage(prompt: list, tokens: int, chat: bool) -> dict:
    """The usage on one choice's chunk (stream_options.continuous_usage_stats): its prompt's tokens and
    the choice's `tokens` so far (the whole choice: a stream sends each choice once, done; 0 on a chat
    role chunk). vLLM's chat chunks set completion_tokens_details (null without a reasoning parser),
    its completion chunks do not."""
    p, c = len(prompt), tokens
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


def event(payload: dict) -> str:
    return f"data: {dumps(payload)}\n\n"


def role_chunks(head: dict, n: int, role: str, prompt: list, with_ids: bool, continuous: bool) -> list:
    """vLLM's first chat chunks: one for each choice, before any text, with the answer's role and
    empty content (a client builds its message from them), the prompt's ids where return_token_ids
    (null otherwise, as vLLM writes them), and the usage so far (0 completion tokens) where
    continuous_usage_stats."""
    usage = {"usage": chunk_usage(prompt, 0, True)} if continuous else {}
    return [{**head, "choices": [{"index": i, "delta": {"role": role, "content": ""}, "logprobs": None,
                                  "finish_reason": None}], **usage,
             "prompt_token_ids": prompt if with_ids else None, "prompt_text": None} for i in range(n)]


async def streamed(completions: AsyncIterator, head: dict, choice: Callable, prompts: Sequence[list],
                   usage_in_stream: tuple[bool, bool], chat: bool, opening: Sequence[dict] = ()):
    """Both routes' streamed answer, as vLLM's stream generators write it for choices that come
    whole; or the refusal that came before the first choice (started). The stream: the `opening`
    chunks, then a chunk for each completion (`choice(c)` gives its Output and its choice), with
    its usage so far where continuous_usage_stats, the request's usage where include_usage
    (`usage_in_stream`, as Sampling.usage_in_stream gives them), then [DONE]; a failure after the
    answer started is an error event before [DONE]. `chat`: vLLM's chat chunks' usage (chunk_usage)."""
    include_usage, continuous = usage_in_stream
    try:
        completions = await started(completions)
    except ProtocolError as e:
        return error(e)

    async def events():
        outputs = []
        try:
            for chunk in opening:
                yield event(chunk)
            async for c in completions:
                out, ch = choice(c)
                outputs.append(out)
                each = {"usage": chunk_usage(prompts[c.prompt_index], len(out.token_ids), chat)} if continuous else {}
                yield event({**head, "choices": [ch], **each})
            if include_usage:
                yield event({**head, "choices": [], "usage": last_usage(prompts, outputs)})
        except ProtocolError as e:
            yield event(error_body(e))
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
