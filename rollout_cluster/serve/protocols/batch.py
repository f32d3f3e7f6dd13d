"""What the protocols share: a request's prompts and sampling into one batch for the router, and
its completions back as text, with stop strings applied.

A request is checked whole before anything is submitted (vLLM refuses a bad request whole too):
its prompts against the engine's vocabulary and context, its sampling against vLLM's ranges and
the config's `limits`. One request is one batch to the router, so its samples are balanced and
migrated across replicas like any other batch.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import accumulate
from typing import AsyncIterator, Optional

from fastapi.responses import JSONResponse

from ...client.expand import expand
from ...client.loops import follow_batch
from ...config import LimitsConfig
from ...parsing import DuplicateKeyError, NestingError, load_json, shown
from ...protocol import (Completion, InputError, LimitExceeded, ModelInfo, RouterBusy, SamplingSpec,
                         is_int)
from ...text.codec import NoTokenizer, TextCodec
from ...validation import check_request
from ..http_body import read_bounded

log = logging.getLogger("ray.serve")


class ProtocolError(Exception):
    """A request refused: the HTTP status, a message naming the field, and the field (`param`)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, kind: str = "BadRequestError",
                 retry_after_s: Optional[int] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.retry_after_s = retry_after_s


@dataclass
class ProtocolContext:
    """What every protocol route needs from the Gateway."""

    router: object  # the Router's handle (a SignedRouter in the Gateway: it cancels what it runs)
    codec: Optional[TextCodec]  # the model's tokenizer; None: prompts are token ids, no text comes back
    limits: LimitsConfig  # the config's limits (n, batch size, the Retry-After of a busy answer)
    call_timeout_s: float  # bound on each router call
    model_name: str  # the id /v1/models lists; a request may name it (or the model's path)
    model_root: str  # the model's path
    batch_timeout_s: float = 3600.0  # a request's batch is cancelled past this
    world_size: int = 1  # GPUs (tensor-parallel ranks) per engine, for TRL's /get_world_size
    logprobs_mode: str = "raw_logprobs"  # the engines' (engine.logprobs_mode), for TRL's /server_info
    _model: Optional[ModelInfo] = field(default=None, repr=False)  # the engine's limits, once a replica said them
    # each token id's text on its own, as the tokenizer decoded it once (bounded by the vocabulary)
    _token_texts: dict = field(default_factory=dict, repr=False)
    _chars_per_token: int = field(default=0, repr=False)  # the most characters one token covers, once computed

    async def model_info(self) -> Optional[ModelInfo]:
        if self._model is None:
            st = await self.router.status.remote()
            if st.get("model"):
                self._model = ModelInfo(**st["model"])
        return self._model

    def token_texts(self, ids: list) -> list[str]:
        """Each token of `ids` decoded on its own (OpenAI's logprobs tokens): one tokenizer call per
        token id ever seen, not per token of every answer."""
        known = self._token_texts
        new = list({t for t in ids if t not in known})
        if new:
            known.update(zip(new, self.codec.token_texts(new)))
        return [known[t] for t in ids]

    def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """codec.encode(text), refused unread when `text` holds more characters than max_model_len
        tokens can: tokenizing the body's 64 MiB of text took the event loop ~50 s and GiBs of ids,
        only to refuse the prompt as longer than the context."""
        if self._model is not None:
            if not self._chars_per_token:  # byte-level BPE: a token's vocabulary string has a char per byte
                # (at least 100: a WordPiece [UNK] stands for a whole word of up to 100 characters)
                self._chars_per_token = max(100, max(map(len, self.codec.tokenizer.get_vocab()), default=0))
            limit = self._model.max_model_len * self._chars_per_token
            if len(text) > limit:
                raise ProtocolError(400, f"{param}: {len(text)} characters, more than the model's context could hold "
                                         f"(max_model_len={self._model.max_model_len} tokens of at most "
                                         f"{self._chars_per_token} characters)", param)
        return self.codec.encode(text, add_special_tokens)

    def names_model(self, name) -> bool:
        return name in (None, "", self.model_name, self.model_root)


async def read_json(request, limits: LimitsConfig) -> dict:
    """The body as a JSON object, read within limits.max_body_bytes; ProtocolError otherwise."""
    body = await read_bounded(request, limits.max_body_bytes)
    if body is None:
        raise ProtocolError(413, f"the body is larger than limits.max_body_bytes={limits.max_body_bytes}")
    try:
        text = body.decode("utf-8")
        obj = load_json(text)
    except DuplicateKeyError as e:
        raise ProtocolError(400, f"{e.key} is given twice in one object", e.key) from None
    except NestingError:
        raise ProtocolError(400, "the body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(400, f"the body is not valid JSON ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise ProtocolError(400, "the body must be a JSON object")
    if "\\u" in text:  # only a \u escape makes a surrogate: valid UTF-8 holds none
        _refuse_surrogates(obj)
    return obj


SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads joins a pair into one character: any left is alone


def _refuse_surrogates(obj) -> None:
    """ProtocolError naming the first string (or key) of `obj` that holds a lone UTF-16 surrogate
    (JSON's "\\ud800"): no text, which the tokenizer refuses with a TypeError and an answer that
    echoes it cannot encode as UTF-8 (both were 500s). Strings are checked where they lie; only
    non-empty containers are stacked."""
    stack = [(obj, "")]
    while stack:
        value, where = stack.pop()
        for key, item in (value.items() if isinstance(value, dict) else enumerate(value)):
            if isinstance(key, str) and SURROGATE.search(key):
                raise ProtocolError(400, f"{where or 'body'}: the key {shown(key)} holds a lone UTF-16 surrogate, "
                                         "not text", where or None)
            if isinstance(item, str) and SURROGATE.search(item):
                name = _member(where, key)
                raise ProtocolError(400, f"{name}={shown(item)}: holds a lone UTF-16 surrogate, not text", name)
            if isinstance(item, (dict, list)) and item:
                stack.append((item, _member(where, key)))


def _member(where: str, key) -> str:
    if isinstance(key, int):
        return f"{where}[{key}]"
    return f"{where}.{key}" if where else key


def prompt_ids(ctx: ProtocolContext, prompt, param: str, add_special_tokens: bool = True) -> list[int]:
    """A prompt as token ids: a string goes through the model's tokenizer, a list must hold ids."""
    if isinstance(prompt, str):
        if ctx.codec is None:
            raise ProtocolError(400, f"{param}: the model has no tokenizer (tokenizer.json): send token ids", param)
        if not prompt:
            raise ProtocolError(400, f"{param}: must not be empty", param)
        return ctx.encode(prompt, param, add_special_tokens)
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return list(prompt)
    raise ProtocolError(400, f"{param}: must be a non-empty string or a non-empty list of token ids", param)


def chat_prompt(ctx: ProtocolContext, messages, param: str, template_kwargs: Optional[dict] = None) -> list[int]:
    """A conversation's prompt through the model's chat template, as token ids."""
    if ctx.codec is None:
        raise ProtocolError(400, f"{param}: the model has no tokenizer (tokenizer.json), so no chat", param)
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ProtocolError(400, f"{param}: must be a non-empty list of messages", param)
    messages = [dict(m, content=_text_content(m.get("content"), f"{param}[{i}].content")) if isinstance(
        m.get("content"), list) else m for i, m in enumerate(messages)]
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ProtocolError(400, f"{param}[{i}]: needs a string role and a string content", f"{param}[{i}]")
    try:
        text = ctx.codec.render_chat(messages, True, **(template_kwargs or {}))
    except NoTokenizer as e:
        raise ProtocolError(400, f"{param}: {e}", param) from None
    except Exception as e:  # the template raised (raise_exception) or did not render
        raise ProtocolError(400, f"{param}: the chat template refused it: {e}", param) from None
    return ctx.encode(text, param, add_special_tokens=False)


def _text_content(parts: list, param: str) -> str:
    """OpenAI's content parts, text only: their texts joined (an image part is refused by name)."""
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ProtocolError(400, f"{param}[{j}]: a {kind!r} part; only text parts are supported", f"{param}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def spec_of(fields: dict) -> SamplingSpec:
    """A SamplingSpec from the protocol's sampling fields (already named as SamplingSpec's);
    ProtocolError naming the first bad one."""
    try:
        spec = SamplingSpec(**fields)
        spec.validate()
    except InputError as e:
        raise ProtocolError(400, str(e), e.field) from None
    except TypeError as e:
        raise ProtocolError(400, str(e)) from None
    return spec


async def checked_requests(ctx: ProtocolContext, prompts: list, spec: SamplingSpec,
                           session: Optional[str] = None) -> list:
    """The batch's SequenceRequests (prompt-major), every one checked against the engine's limits.
    `session`: the multi-turn session every prompt of the request is a turn of (session affinity)."""
    limits = ctx.limits
    if spec.n > limits.max_n:
        raise ProtocolError(400, f"n={spec.n}: at most limits.max_n={limits.max_n} samples per prompt", "n")
    if len(prompts) * spec.n > limits.max_batch_sequences:
        raise ProtocolError(400, f"{len(prompts)} prompts x n={spec.n}: at most limits.max_batch_sequences="
                                 f"{limits.max_batch_sequences} sequences a request", "prompt")
    requests = expand(prompts, spec, sessions=None if session is None else [session] * len(prompts))
    model = await ctx.model_info()
    for req in requests[::spec.n]:
        try:
            check_request(req, model)
        except InputError as e:
            where = f" (prompt {req.prompt_index})" if len(prompts) > 1 else ""
            raise ProtocolError(400, f"{e}{where}", e.field) from None
    return requests


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


@dataclass
class Output:
    """One sample as a protocol returns it."""

    token_ids: list  # generated ids (cut after a stop string)
    logprobs: Optional[list]  # the sampled tokens' logprobs, aligned with token_ids
    text: str  # token_ids decoded ("" without a tokenizer)
    finish_reason: str  # "stop", "length" or "abort"
    stop_reason: object = None  # the stop string that ended it


def output_of(ctx: ProtocolContext, c: Completion, stops: list, include_stop: bool = False) -> Output:
    """A completion as text, cut at the first stop string (the engines run without detokenizer,
    so stop strings are applied here, on the whole output)."""
    ids, logprobs = list(c.token_ids), (list(c.logprobs) if c.logprobs is not None else None)
    if ctx.codec is None:
        return Output(ids, logprobs, "", c.finish_reason)
    if stops:
        from tokenizers.decoders import DecodeStream

        # The text a token at a time, then each stop searched once in the whole of it: the first
        # token whose text completes a stop's first occurrence cuts (ties: the earlier, then the
        # lesser stop). Searching the text so far after every token cost tokens^2 x stops.
        stream = DecodeStream(skip_special_tokens=True)
        pieces = [stream.step(ctx.codec.tokenizer, t) or "" for t in ids]
        ends, text = list(accumulate(map(len, pieces))), "".join(pieces)
        hits = ((bisect_left(ends, at + len(s)), at, s) for s in stops if s for at in (text.find(s),) if at >= 0)
        hit = min(hits, default=None)
        if hit is not None:
            k, at, s = hit
            return Output(ids[:k + 1], logprobs[:k + 1] if logprobs is not None else None,
                          text[:at + len(s)] if include_stop else text[:at], "stop", s)
    return Output(ids, logprobs, ctx.codec.decode(ids), c.finish_reason)


# Stop strings a request may give: each is searched in every output's text (vLLM sets no bound;
# OpenAI's API takes 4)
MAX_STOP_STRINGS = 256


def stop_list(value, param: str = "stop") -> list:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        if len(value) > MAX_STOP_STRINGS:
            raise ProtocolError(400, f"{param}: {len(value)} stop strings; at most {MAX_STOP_STRINGS}", param)
        return value
    raise ProtocolError(400, f"{param}: must be a string or a list of strings", param)


class Answer(JSONResponse):
    """JSONResponse that writes a NaN logprob as NaN (as the streamed and JSONL answers do, and
    Python's json reads): Starlette's refuses it, and a model whose weights went NaN answered 500."""

    def render(self, content) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=True, indent=None, separators=(",", ":")).encode()


def answer(body: dict) -> JSONResponse:
    """A batch's answer, rendered here: a dict returned from a route goes through FastAPI's
    jsonable_encoder first, which walks every token's list and float in Python (150-220 ms of CPU
    for 64 x 128 tokens on the local CPU VM, against 20-45 ms for the JSON itself; the answer's
    bytes are the same: JSONResponse renders either)."""
    return Answer(body)


def dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
