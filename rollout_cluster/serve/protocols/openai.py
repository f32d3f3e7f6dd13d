"""OpenAI-compatible routes, as vLLM's server extends them: GET /v1/models, POST /v1/completions
and POST /v1/chat/completions (JSON, or server-sent events with `stream`), with vLLM's
`return_token_ids` and `return_tokens_as_token_ids`. Errors come in OpenAI's shape,
{"error": {"message", "type", "param", "code"}}, with the same status as vLLM's server.

What differs from vLLM's server (docs/trainers.md): the engines return the sampled token's
logprob only, so `logprobs` (completions) and `top_logprobs` (chat) must be 0; stop strings are
applied to each whole output; a stream sends each choice whole, once it is done; `echo`,
`best_of`, beam search, structured outputs, logit bias and prompt logprobs are refused by name.
"""
from __future__ import annotations

import time
import uuid
from itertools import accumulate
from typing import AsyncIterator, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from .batch import (ProtocolContext, ProtocolError, answer, checked_requests, chat_prompt, dumps, output_of,
                    prompt_ids, read_json, run_batch, spec_of, stop_list, stream_batch)

# Fields vLLM's server takes that this one cannot honour: refused by name when set.
UNSUPPORTED = {"echo": False, "best_of": None, "use_beam_search": False, "suffix": None, "logit_bias": None,
               "prompt_logprobs": None, "structured_outputs": None, "response_format": None, "guided_json": None,
               "guided_regex": None, "guided_choice": None, "allowed_token_ids": None, "bad_words": None,
               "continue_final_message": False, "prompt_embeds": None, "logprob_token_ids": None,
               "chat_template": None}  # (a client's own chat template: the model's is the one rendered)


class Sampling(BaseModel):
    """The sampling fields both routes take (vLLM's names and defaults)."""

    # strict: JSON's true, 2.0 or "2" is no count and no token id (lax pydantic made them 1 and 2)
    model_config = ConfigDict(extra="allow", strict=True)
    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    cache_salt: Optional[str] = None
    stream: bool = False
    stream_options: Optional[dict] = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    user: Optional[str] = None

    def spec_fields(self, max_tokens: int, logprobs: Optional[int]) -> dict:
        for key, default in UNSUPPORTED.items():
            if (self.model_extra or {}).get(key, default) not in (default, None, False):
                raise ProtocolError(400, f"{key}: not supported by rollout_cluster", key)
        fields = {"n": self.n, "max_tokens": max_tokens, "min_tokens": self.min_tokens, "ignore_eos": self.ignore_eos,
                  "logprobs": logprobs, "seed": self.seed, "stop_token_ids": tuple(self.stop_token_ids or ()),
                  "cache_salt": self.cache_salt}
        for name, value in (("temperature", self.temperature), ("top_p", self.top_p), ("top_k", self.top_k),
                            ("min_p", self.min_p),
                            ("repetition_penalty", self.repetition_penalty),
                            ("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)):
            if value is not None:
                fields[name] = value
        return fields


SESSION_HEADER = "X-Session-Id"


def session_of(request: Request, body: Sampling) -> Optional[str]:
    """The multi-turn session a request is a turn of: the X-Session-Id header, else OpenAI's `user`
    field (router/sessions.py sends the session's turns to the replica that ran the previous one)."""
    return request.headers.get(SESSION_HEADER) or body.user


class CompletionBody(Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None


class ChatBody(Sampling):
    messages: list[dict]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = 0
    chat_template_kwargs: Optional[dict] = None
    tools: Optional[list] = None
    add_generation_prompt: bool = True


def error(e: ProtocolError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s else None
    return JSONResponse({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.status}},
                        status_code=e.status, headers=headers)


def _parse(model: type, body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ProtocolError(400, f"body.{where}={first.get('input')!r}: {first['msg']}", f"body.{where}") from None


def _check_model(ctx: ProtocolContext, name) -> None:
    if not ctx.names_model(name):
        raise ProtocolError(404, f"The model `{name}` does not exist. Valid: {ctx.model_name}", "model",
                            "NotFoundError")


def _sampled_logprobs(value: Optional[int], param: str) -> Optional[int]:
    if value is None:
        return None
    if value != 0:
        raise ProtocolError(400, f"{param}={value}: only the sampled token's logprob is available ({param}=0)", param)
    return 0


def _token_strings(ctx: ProtocolContext, ids: list, as_ids: bool) -> list:
    if as_ids or ctx.codec is None:
        return [f"token_id:{t}" for t in ids]
    return ctx.token_texts(ids)


def _completion_logprobs(ctx: ProtocolContext, out, as_ids: bool, offset: int = 0) -> dict:
    tokens = _token_strings(ctx, out.token_ids, as_ids)
    lps = [-9999.0 if lp < -9999.0 else lp for lp in out.logprobs]  # max(lp, -9999.0), NaN kept
    offsets = list(accumulate(map(len, tokens), initial=offset))[:-1]
    return {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens,
            "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, lps)]}


def _chat_logprobs(ctx: ProtocolContext, out, as_ids: bool) -> dict:
    tokens = _token_strings(ctx, out.token_ids, as_ids)
    return {"content": [{"token": tok, "logprob": max(lp, -9999.0), "bytes": list(tok.encode("utf-8")),
                         "top_logprobs": []} for tok, lp in zip(tokens, out.logprobs)]}


def _usage(prompts: list, outputs: list) -> dict:
    p, c = sum(len(x) for x in prompts), sum(len(o.token_ids) for o in outputs)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c, "prompt_tokens_details": None}


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


def openai_routes(ctx: ProtocolContext) -> APIRouter:
    api = APIRouter()

    @api.get("/v1/models", summary="OpenAI: the served model")
    async def models():
        model = await ctx.model_info()
        return {"object": "list", "data": [{
            "id": ctx.model_name, "object": "model", "created": int(time.time()), "owned_by": "rollout_cluster",
            "root": ctx.model_root, "parent": None, "max_model_len": model.max_model_len if model else None,
            "permission": []}]}

    @api.post("/v1/completions", summary="OpenAI: completions (vLLM's extensions; stream as server-sent events)")
    async def completions(request: Request):
        try:
            body = _parse(CompletionBody, await read_json(request, ctx.limits))
            _check_model(ctx, body.model)
            await ctx.model_info()  # its max_model_len bounds the text tokenized
            raw = body.prompt
            if isinstance(raw, str) or (isinstance(raw, list) and raw and not isinstance(raw[0], (str, list))):
                raw = [raw]
            if not raw:
                raise ProtocolError(400, "prompt: must not be empty", "prompt")
            prompts = [prompt_ids(ctx, p, "prompt" if len(raw) == 1 else f"prompt[{i}]") for i, p in enumerate(raw)]
            logprobs = _sampled_logprobs(body.logprobs, "logprobs")
            if body.max_tokens is None:
                body.max_tokens = 16
            spec = spec_of(body.spec_fields(body.max_tokens, logprobs))
            stops = stop_list(body.stop)
            requests = await checked_requests(ctx, prompts, spec, session_of(request, body))
        except ProtocolError as e:
            return error(e)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name}

        def choice(c):
            out = output_of(ctx, c, stops, body.include_stop_str_in_output)
            lp = _completion_logprobs(ctx, out, body.return_tokens_as_token_ids) if logprobs is not None else None
            ids = body.return_token_ids
            return out, {"index": c.index, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason,
                         "stop_reason": out.stop_reason, "token_ids": out.token_ids if ids else None,
                         "prompt_logprobs": None, "prompt_token_ids": prompts[c.prompt_index] if ids else None}

        if body.stream:
            try:
                completions = await started(stream_batch(ctx, requests))
            except ProtocolError as e:
                return error(e)

            async def events():
                outputs = []
                try:
                    async for c in completions:
                        out, ch = choice(c)
                        outputs.append(out)
                        yield f"data: {dumps({**head, 'choices': [ch]})}\n\n"
                    if (body.stream_options or {}).get("include_usage"):
                        yield f"data: {dumps({**head, 'choices': [], 'usage': _usage(prompts, outputs)})}\n\n"
                except ProtocolError as e:
                    yield f"data: {dumps({'error': {'message': e.message, 'type': e.kind, 'param': e.param, 'code': e.status}})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        try:
            results = await run_batch(ctx, requests)
        except ProtocolError as e:
            return error(e)
        pairs = [choice(c) for c in results]
        return answer({**head, "choices": [ch for _, ch in pairs], "usage": _usage(prompts, [o for o, _ in pairs])})

    @api.post("/v1/chat/completions", summary="OpenAI: chat completions (one conversation; stream as server-sent events)")
    async def chat(request: Request):
        try:
            body = _parse(ChatBody, await read_json(request, ctx.limits))
            _check_model(ctx, body.model)
            kwargs = dict(body.chat_template_kwargs or {})
            tool_choice = (body.model_extra or {}).get("tool_choice")
            if tool_choice not in (None, "none", "auto"):  # vLLM forces the call with structured outputs
                raise ProtocolError(400, f"tool_choice={tool_choice!r}: forcing a tool call (structured outputs) is "
                                         "not supported by rollout_cluster; use \"none\" or \"auto\"", "tool_choice")
            if body.tools:
                kwargs["tools"] = body.tools
            model = await ctx.model_info()  # its max_model_len bounds the text tokenized
            prompt = chat_prompt(ctx, body.messages, "messages", kwargs)
            if body.top_logprobs and not body.logprobs:  # as vLLM's server refuses it, not ignored
                raise ProtocolError(400, f"top_logprobs={body.top_logprobs}: needs logprobs true", "top_logprobs")
            logprobs = _sampled_logprobs(body.top_logprobs or 0, "top_logprobs") if body.logprobs else None
            max_tokens = body.max_completion_tokens or body.max_tokens
            if max_tokens is None:  # vLLM's: whatever room the context leaves
                max_tokens = max(1, (model.max_model_len if model else 4096) - len(prompt))
            spec = spec_of(body.spec_fields(max_tokens, logprobs))
            stops = stop_list(body.stop)
            requests = await checked_requests(ctx, [prompt], spec, session_of(request, body))
        except ProtocolError as e:
            return error(e)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        ids = body.return_token_ids

        def choice(c, key: str):
            out = output_of(ctx, c, stops, body.include_stop_str_in_output)
            lp = _chat_logprobs(ctx, out, body.return_tokens_as_token_ids) if logprobs is not None else None
            return out, {"index": c.index, key: {"role": "assistant", "content": out.text, "tool_calls": [],
                                                 "reasoning": None},
                         "logprobs": lp, "finish_reason": out.finish_reason, "stop_reason": out.stop_reason,
                         "token_ids": out.token_ids if ids else None}

        if body.stream:
            head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name}

            try:
                completions = await started(stream_batch(ctx, requests))
            except ProtocolError as e:
                return error(e)

            async def events():
                outputs, first = [], True
                try:
                    async for c in completions:
                        out, ch = choice(c, "delta")
                        outputs.append(out)
                        extra = {"prompt_token_ids": prompt} if ids and first else {}
                        first = False
                        yield f"data: {dumps({**head, 'choices': [ch], **extra})}\n\n"
                    if (body.stream_options or {}).get("include_usage"):
                        yield f"data: {dumps({**head, 'choices': [], 'usage': _usage([prompt], outputs)})}\n\n"
                except ProtocolError as e:
                    yield f"data: {dumps({'error': {'message': e.message, 'type': e.kind, 'param': e.param, 'code': e.status}})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        try:
            results = await run_batch(ctx, requests)
        except ProtocolError as e:
            return error(e)
        pairs = [choice(c, "message") for c in results]
        return answer({"id": rid, "object": "chat.completion", "created": created, "model": ctx.model_name,
                       "choices": [ch for _, ch in pairs], "usage": _usage([prompt], [o for o, _ in pairs]),
                       "prompt_token_ids": prompt if ids else None})

    return api
