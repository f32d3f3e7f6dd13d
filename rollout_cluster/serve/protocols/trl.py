"""The routes of TRL's `trl vllm-serve`, so that TRL's VLLMClient (and GRPOTrainer with
vllm_mode="server") talks to the whole fleet as to one vLLM server.

- TRL up to 1.10 speaks its own protocol: GET /health/, GET /get_world_size/, POST /generate/
  (prompts as strings or token-id lists), POST /chat/ (a batch of conversations),
  POST /reset_prefix_cache/; TRL 0.25-0.29 send `truncate_prompt_tokens` too (truncation.py). Answers: {prompt_ids, completion_ids, logprobs, logprob_token_ids};
  a bad field is FastAPI's 422 naming it, as TRL's own server answers.
- TRL from 1.11 talks to vLLM's OpenAI server (openai.py) plus GET /health, GET /get_world_size
  and POST /reset_prefix_cache, served here.
The weight routes (TRL <= 1.10's /init_communicator/, /update_named_param/, /close_communicator/
and vLLM's weight-transfer routes that TRL >= 1.11 calls) are in trl_weights.py, over the weight
relay: the trainer's group has two ranks, its own and the relay's, so the world size answered
here is 1 whatever the fleet's size.

TRL's client retries a POST answered 500, 502 or 503; a full router answers 503 with Retry-After
(nothing of the request was registered, so the retry is safe), and a bad request never answers 500.
"""
from __future__ import annotations

from typing import Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from ...parsing import shown
from ..router_reach import RouterAbsent, router_call
from .answers import answer
from .batch import run_batch
from .context import ProtocolContext, ProtocolError
from .json_body import read_json
from .outputs import output_of, stops_of
from .prompts import chat_prompt, check_count, checked_requests, prompt_ids, spec_of
from .truncation import sampling_truncation_of

# generation_kwargs keys (vLLM SamplingParams names) this cluster honours, beyond the request's fields
GENERATION_KWARGS = {"ignore_eos", "min_tokens", "seed", "stop_token_ids", "presence_penalty", "frequency_penalty",
                     "max_tokens", "temperature", "top_p", "top_k", "n", "repetition_penalty", "logprobs", "stop",
                     "include_stop_str_in_output", "min_p", "cache_salt"}


class TRLSampling(BaseModel):
    # strict: JSON's true, 2.0 or "2" is no count and no token id (lax pydantic made them 1 and 2)
    model_config = ConfigDict(extra="forbid", strict=True)
    n: int = 1
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    logprobs: Optional[int] = 0
    images: Optional[list] = None
    structured_outputs_regex: Optional[str] = None
    guided_decoding_regex: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None
    generation_kwargs: dict = {}


class GenerateRequest(TRLSampling):
    prompts: Union[list[str], list[list[int]]]


class ChatRequest(TRLSampling):
    messages: list[list[dict]]
    chat_template_kwargs: dict = {}
    tools: Optional[list] = None


def unprocessable(field: str, message: str, value=None) -> JSONResponse:
    """FastAPI's 422, as TRL's own server answers a bad field."""
    return JSONResponse({"detail": [{"type": "value_error", "loc": ["body", field], "msg": message,
                                     "input": value}]}, status_code=422)


def refusal(e: ProtocolError) -> JSONResponse:
    if e.status == 400:
        return unprocessable(e.param or "body", e.message)
    headers = {"Retry-After": str(e.retry_after_s)} if e.retry_after_s else None
    return JSONResponse({"detail": e.message}, status_code=e.status, headers=headers)


def parse_model(model: type, body: dict):
    """`body` as `model`, or ProtocolError naming the first bad field (a 422 in TRL's shape)."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        raise ProtocolError(400, f"{first['msg']}", ".".join(str(p) for p in first["loc"])) from None


def _spec(ctx: ProtocolContext, req: TRLSampling) -> tuple:
    """(SamplingSpec, stop strings, include_stop) of a request: its fields, then generation_kwargs over them."""
    for name in ("images", "structured_outputs_regex", "guided_decoding_regex"):
        if getattr(req, name) is not None:
            raise ProtocolError(400, f"{name}: not supported by rollout_cluster", name)
    fields = {"n": req.n, "repetition_penalty": req.repetition_penalty, "temperature": req.temperature,
              "top_p": req.top_p, "top_k": req.top_k, "max_tokens": req.max_tokens, "logprobs": req.logprobs,
              "min_p": req.min_p}
    for key, value in req.generation_kwargs.items():
        if key not in GENERATION_KWARGS:
            raise ProtocolError(400, f"generation_kwargs.{key}: not supported (supported: "
                                     f"{', '.join(sorted(GENERATION_KWARGS))})", f"generation_kwargs.{key}")
        fields[key] = value
    stops = stops_of(ctx, fields.pop("stop", None), "generation_kwargs.stop")
    include = fields.pop("include_stop_str_in_output", False)
    if not isinstance(include, bool):
        raise ProtocolError(400, f"generation_kwargs.include_stop_str_in_output={include!r}: must be true or false",
                            "generation_kwargs.include_stop_str_in_output")
    if fields.get("logprobs") not in (None, 0):
        raise ProtocolError(400, f"logprobs={shown(fields['logprobs'])}: only the sampled token's logprob is available "
                                 "(logprobs=0)", "logprobs")
    if "stop_token_ids" in fields and isinstance(fields["stop_token_ids"], list):
        fields["stop_token_ids"] = tuple(fields["stop_token_ids"])
    return spec_of(fields), stops, include


async def _read(ctx: ProtocolContext, req) -> tuple:
    """A /generate/ or /chat/ request's (spec, stops, include_stop_str_in_output, truncation): the
    served model's max_model_len bounds the text tokenized."""
    spec, stops, include = _spec(ctx, req)
    model = await ctx.model_info()
    cut = sampling_truncation_of(req.truncate_prompt_tokens, model.max_model_len if model else None, spec.max_tokens)
    return spec, stops, include, cut


async def _answer(ctx: ProtocolContext, prompts: list, spec, stops: list, include: bool, field: str) -> JSONResponse:
    requests = await checked_requests(ctx, prompts, spec, field=field)
    outputs = [output_of(ctx, c, stops, include, prompt_ids=prompts[c.prompt_index], min_tokens=spec.min_tokens)
               for c in await run_batch(ctx, requests)]
    with_logprobs = spec.logprobs is not None
    return answer({"prompt_ids": prompts, "completion_ids": [o.token_ids for o in outputs],
                   "logprobs": [[[lp] for lp in o.logprobs] for o in outputs] if with_logprobs else None,
                   "logprob_token_ids": [[[t] for t in o.token_ids] for o in outputs] if with_logprobs else None})


# The ranks a trainer's weight group needs besides its own: the relay's one (trl_weights.py). TRL
# makes a group of this + 1 and takes the last rank (<= 1.10) or rank 0 (>= 1.11) for itself.
RELAY_WORLD_SIZE = 1


def trl_routes(ctx: ProtocolContext, relay=None) -> APIRouter:
    """`relay`: trl_weights.RelayRunner, whose update /reset_prefix_cache/ waits for, and whose
    backend /server_info names (None: no weight routes, and /server_info says so)."""
    api = APIRouter()

    @api.get("/health/", summary="TRL <= 1.10: liveness (no token needed)")
    async def health_legacy():
        return {"status": "ok"}

    @api.get("/health", summary="TRL >= 1.11 / vLLM: liveness (no token needed)")
    async def health():
        return Response(status_code=200)

    @api.get("/get_world_size/", summary="TRL <= 1.10: the ranks that join a trainer's weight group (the relay)")
    async def world_size_legacy():
        return {"world_size": RELAY_WORLD_SIZE}

    @api.get("/get_world_size", summary="TRL >= 1.11: the ranks that join a trainer's weight group (the relay)")
    async def world_size():
        return {"world_size": RELAY_WORLD_SIZE}

    @api.get("/server_info", summary="vLLM's dev route, as TRL >= 1.11 reads it: the parts of the config it asks")
    async def server_info():
        try:
            model = await ctx.model_info()
        except ProtocolError as e:  # no router answers: 503
            return refusal(e)
        return {"vllm_config": {"model_config": {
            "model": ctx.model_name, "logprobs_mode": ctx.logprobs_mode,
            "max_model_len": model.max_model_len if model else None,
            "max_logprobs": model.max_logprobs if model else None},
            "parallel_config": {"tensor_parallel_size": ctx.world_size},
            # the relay's data plane (channels.py); TRL's init_communicator needs it set
            "weight_transfer_config": {"backend": relay.relay.backend} if relay is not None else None}}

    @api.post("/generate/", summary="TRL <= 1.10: prompts (strings or token ids) x n samples")
    async def generate(request: Request):
        try:
            req = parse_model(GenerateRequest, await read_json(request, ctx.limits))
            spec, stops, include, cut = await _read(ctx, req)
            check_count(ctx, len(req.prompts), spec.n, "prompts")  # (before any is tokenized)
            prompts = [prompt_ids(ctx, p, f"prompts[{i}]", truncation=cut) for i, p in enumerate(req.prompts)]
            if not prompts:
                raise ProtocolError(400, "prompts: must not be empty", "prompts")
            return await _answer(ctx, prompts, spec, stops, include, "prompts")
        except ProtocolError as e:
            return refusal(e)

    @api.post("/chat/", summary="TRL <= 1.10: conversations x n samples, through the chat template")
    async def chat(request: Request):
        try:
            req = parse_model(ChatRequest, await read_json(request, ctx.limits))
            spec, stops, include, cut = await _read(ctx, req)
            kwargs = dict(req.chat_template_kwargs)
            # vLLM's LLM.chat (behind trl vllm-serve) lays chat_template_kwargs over its own arguments
            generation_prompt = kwargs.pop("add_generation_prompt", True)
            if not isinstance(generation_prompt, bool):
                raise ProtocolError(400, f"chat_template_kwargs.add_generation_prompt={generation_prompt!r:.80}: "
                                         "must be true or false", "chat_template_kwargs.add_generation_prompt")
            if req.tools:
                kwargs["tools"] = req.tools
            check_count(ctx, len(req.messages), spec.n, "messages")  # (before any is rendered)
            prompts = [chat_prompt(ctx, m, f"messages[{i}]", kwargs, truncation=cut,
                                   add_generation_prompt=generation_prompt)
                       for i, m in enumerate(req.messages)]
            if not prompts:
                raise ProtocolError(400, "messages: must not be empty", "messages")
            return await _answer(ctx, prompts, spec, stops, include, "messages")
        except ProtocolError as e:
            return refusal(e)

    async def reset_answer(body) -> JSONResponse:
        try:
            if relay is not None:  # TRL <= 1.10 calls it after an update: the fleet holds the update first
                await relay.call("settle")
        except Exception as e:  # the relay's update failed: 409, which TRL's client does not retry
            return JSONResponse({"detail": f"weight update failed: {e}"}, status_code=409)
        try:
            done = bool(await router_call(ctx.router, "reset_prefix_cache", ctx.call_timeout_s))
        except RouterAbsent as e:  # 503, which it retries: dropping the caches again is harmless
            return refusal(ProtocolError(503, str(e), kind="ServiceUnavailableError",
                                         retry_after_s=ctx.limits.retry_after_s))
        except Exception as e:
            return JSONResponse({"detail": f"weight update failed: {e}"}, status_code=409)
        return JSONResponse(body(done))

    @api.post("/reset_prefix_cache/", summary="TRL <= 1.10: every engine drops its prefix cache")
    async def reset_legacy():
        return await reset_answer(lambda done: {"message": f"Request received, resetting prefix cache status: {done}"})

    @api.post("/reset_prefix_cache", summary="TRL >= 1.11 / vLLM: every engine drops its prefix cache")
    async def reset_new():
        return await reset_answer(lambda done: {"success": done})

    return api
