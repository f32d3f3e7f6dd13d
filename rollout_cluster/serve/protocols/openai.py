"""OpenAI-compatible routes, as vLLM's server extends them: GET /v1/models, POST /v1/completions
and POST /v1/chat/completions (JSON, or server-sent events with `stream`), with vLLM's
`return_token_ids` and `return_tokens_as_token_ids`. Errors come in OpenAI's shape,
{"error": {"message", "type", "param", "code"}}, with the same status as vLLM's server.

What differs from vLLM's server (docs/trainers.md): the engines return the sampled token's
logprob only, so `logprobs` (completions) and `top_logprobs` (chat) must be 0; stop strings are
applied to each whole output; a stream sends each choice whole, once it is done (a chat stream
first sends each choice's role chunk, as vLLM's does); a request's `chat_template` must name one
of the model's templates (vLLM takes a template's text too, with --trust-request-chat-template);
`echo`, `best_of`, beam search, structured outputs, logit bias and prompt logprobs are refused by name.
Every other field of vLLM's request models is honoured, ignored for a stated reason, or refused by
name (openai_bodies.py).
"""
from __future__ import annotations

import time

from fastapi import APIRouter, Request

from .answers import answer
from .batch import run_batch, stream_batch
from .context import ProtocolContext, ProtocolError
from .json_body import read_json
from .openai_answers import (chat_logprobs, completion_logprobs, error, role_chunks, sampled_logprobs, streamed,
                             usage)
from .openai_bodies import ChatBody, CompletionBody, answer_id, check_model, parse_body, session_of
from .outputs import output_of, stops_of
from .prompts import chat_prompt, check_count, checked_requests, prompt_ids, spec_of


def openai_routes(ctx: ProtocolContext) -> APIRouter:
    api = APIRouter()

    @api.get("/v1/models", summary="OpenAI: the served model")
    async def models():
        try:
            model = await ctx.model_info()
        except ProtocolError as e:  # no router answers: 503
            return error(e)
        return {"object": "list", "data": [{
            "id": ctx.model_name, "object": "model", "created": int(time.time()), "owned_by": "rollout_cluster",
            "root": ctx.model_root, "parent": None, "max_model_len": model.max_model_len if model else None,
            "permission": []}]}

    @api.post("/v1/completions", summary="OpenAI: completions (vLLM's extensions; stream as server-sent events)")
    async def completions(request: Request):
        try:
            body = parse_body(CompletionBody, await read_json(request, ctx.limits))
            check_model(ctx, body.model)
            body.check_supported(request.headers)
            model = await ctx.model_info()  # its max_model_len bounds the text tokenized
            if body.max_tokens is None:
                body.max_tokens = 16
            cut = body.truncation(model.max_model_len if model else None, body.max_tokens)
            raw = body.prompt
            if isinstance(raw, str) or (isinstance(raw, list) and raw and not isinstance(raw[0], (str, list))):
                raw = [raw]
            if not raw:
                raise ProtocolError(400, "prompt: must not be empty", "prompt")
            logprobs = sampled_logprobs(body.logprobs, "logprobs")
            spec = spec_of(body.spec_fields(body.max_tokens, logprobs))
            check_count(ctx, len(raw), spec.n)  # (before any prompt is tokenized)
            prompts = [prompt_ids(ctx, p, "prompt" if len(raw) == 1 else f"prompt[{i}]", body.add_special_tokens, cut)
                       for i, p in enumerate(raw)]
            stops = stops_of(ctx, body.stop)
            requests = await checked_requests(ctx, prompts, spec, session_of(request, body))
        except ProtocolError as e:
            return error(e)
        rid, created = answer_id(request, body, "cmpl"), int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": ctx.model_name}

        def choice(c):
            out = output_of(ctx, c, stops, body.include_stop_str_in_output, **body.decoding(),
                            prompt_ids=prompts[c.prompt_index])
            lp = completion_logprobs(ctx, out, body.return_tokens_as_token_ids) if logprobs is not None else None
            ids = body.return_token_ids
            return out, {"index": c.index, "text": out.text, "logprobs": lp, "finish_reason": out.finish_reason,
                         "stop_reason": out.stop_reason, "token_ids": out.token_ids if ids else None,
                         "prompt_logprobs": None, "prompt_token_ids": prompts[c.prompt_index] if ids else None}

        if body.stream:
            return await streamed(stream_batch(ctx, requests), head, choice, prompts, body.usage_in_stream(),
                                  chat=False)
        try:
            results = await run_batch(ctx, requests)
        except ProtocolError as e:
            return error(e)
        pairs = [choice(c) for c in results]
        return answer({**head, "choices": [ch for _, ch in pairs], "usage": usage(prompts, [o for o, _ in pairs])})

    @api.post("/v1/chat/completions", summary="OpenAI: chat completions (one conversation; stream as server-sent events)")
    async def chat(request: Request):
        try:
            body = parse_body(ChatBody, await read_json(request, ctx.limits))
            check_model(ctx, body.model)
            body.check_supported(request.headers)
            model = await ctx.model_info()  # its max_model_len bounds the text tokenized
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            cut = body.truncation(model.max_model_len if model else None, max_tokens or 0)
            prompt = chat_prompt(ctx, body.messages, "messages", body.template_kwargs(), body.add_special_tokens, cut,
                                 body.add_generation_prompt, body.chat_template)
            if body.top_logprobs and not body.logprobs:  # as vLLM's server refuses it, not ignored
                raise ProtocolError(400, f"top_logprobs={body.top_logprobs}: needs logprobs true", "top_logprobs")
            logprobs = sampled_logprobs(body.top_logprobs or 0, "top_logprobs") if body.logprobs else None
            if max_tokens is None:  # vLLM's: whatever room the context leaves
                max_tokens = max(1, (model.max_model_len if model else 4096) - len(prompt))
            spec = spec_of(body.spec_fields(max_tokens, logprobs))
            stops = stops_of(ctx, body.stop)
            requests = await checked_requests(ctx, [prompt], spec, session_of(request, body))
        except ProtocolError as e:
            if e.param == "max_tokens" and body.max_completion_tokens is not None:  # (the name the client sent)
                e = ProtocolError(e.status, e.message.replace("max_tokens", "max_completion_tokens"),
                                  "max_completion_tokens", e.kind, e.retry_after_s)
            return error(e)
        rid, created = answer_id(request, body, "chatcmpl"), int(time.time())
        ids = body.return_token_ids
        # vLLM's: the model speaks as the assistant, or continues the last message in its role
        role = "assistant" if body.add_generation_prompt else body.messages[-1]["role"]

        def choice(c, key: str = "delta"):
            out = output_of(ctx, c, stops, body.include_stop_str_in_output, **body.decoding(), prompt_ids=prompt)
            lp = chat_logprobs(ctx, out, body.return_tokens_as_token_ids) if logprobs is not None else None
            # a chunk's delta is the text alone, as vLLM's: the role came in the choice's role chunk
            said = {"content": out.text} if key == "delta" else {"role": role, "content": out.text, "tool_calls": [],
                                                                  "reasoning": None}
            return out, {"index": c.index, key: said, "logprobs": lp, "finish_reason": out.finish_reason,
                         "stop_reason": out.stop_reason, "token_ids": out.token_ids if ids else None}

        if body.stream:
            head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name}
            usage_in_stream = body.usage_in_stream()
            opening = role_chunks(head, body.n, role, prompt, ids, usage_in_stream[1])
            return await streamed(stream_batch(ctx, requests), head, choice, [prompt], usage_in_stream, chat=True,
                                  opening=opening)
        try:
            results = await run_batch(ctx, requests)
        except ProtocolError as e:
            return error(e)
        pairs = [choice(c, "message") for c in results]
        return answer({"id": rid, "object": "chat.completion", "created": created, "model": ctx.model_name,
                       "choices": [ch for _, ch in pairs], "usage": usage([prompt], [o for o, _ in pairs]),
                       "prompt_token_ids": prompt if ids else None})

    return api
