"""The bodies of the OpenAI-compatible routes (vLLM's names and defaults), parsed strictly. Each
field of vLLM's own request models (vllm.entrypoints.openai.{completion,chat_completion}.protocol)
is one of: declared here and honoured as vLLM honours it; declared here and listed in IGNORED,
with the reason it cannot change the answer; or in REFUSED, refused by name when set to anything
but vLLM's default (tests/test_openai_vllm_fields.py fails on a vLLM field in none of these)."""
from __future__ import annotations

from typing import ClassVar, Literal, Mapping, Optional, Union

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ...parsing import shown
from ...validation import MAX_SESSION_CHARS as MAX_ID_CHARS
from .context import ProtocolContext, ProtocolError
from .truncation import Truncation, truncation_of

_OFF = (None, False)
# Fields vLLM's server takes that this one cannot honour: refused by name unless set to one of
# the values that mean vLLM's default (the accepted values, and why anything else is refused).
# ({} and {"type": "text"}: what clients send for "no bias" and "no structured output", as vLLM serves them)
REFUSED = {"echo": _OFF, "best_of": _OFF, "use_beam_search": _OFF, "suffix": _OFF, "logit_bias": _OFF + ({},),
           "prompt_logprobs": _OFF, "structured_outputs": _OFF, "response_format": _OFF + ({"type": "text"},),
           "guided_json": _OFF,
           "guided_regex": _OFF, "guided_choice": _OFF, "allowed_token_ids": _OFF, "bad_words": (None, False, []),
           "continue_final_message": _OFF, "prompt_embeds": _OFF, "logprob_token_ids": _OFF}
REFUSED = {name: (accepted, "") for name, accepted in REFUSED.items()}
REFUSED.update({
    "watermarking": (_OFF, "the engines run without a watermark"),
    "priority": ((0,), "requests are served first come, first served (vLLM refuses a priority without "
                       "priority scheduling)"),
    "routed_experts_prompt_start": ((0,), "the engines return no routed-expert data"),
    "kv_transfer_params": ((None, {}), "no disaggregated prefill here"),
    "ec_transfer_params": ((None, {}), "no encoder-cache transfer here"),
    "repetition_detection": ((None,), "the engines run without repetition detection"),
    "thinking_token_budget": ((None, -1), "no reasoning parser here to end the thinking"),
    "vllm_xargs": ((None, {}), "only its session_id is taken (custom logits processors' arguments are not)"),
})
CHAT_REFUSED = {
    "include_reasoning": ((True,), "no reasoning parser here: the reasoning stays in `content`"),
    "media_io_kwargs": ((None, {}), "text only (images are refused)"),
    "mm_processor_kwargs": ((None, {}), "text only (images are refused)"),
    "return_prompt_text": (_OFF, "the rendered prompt is not returned (return_token_ids returns its ids)"),
    "tool_choice": ((None, "none", "auto"), "forcing a tool call takes structured outputs; use \"none\" or \"auto\""),
}
# Fields vLLM takes that cannot change the answer here: declared (so their types are checked as
# vLLM checks them) and otherwise unused, for the reason given.
IGNORED = {
    "stream_interval": "a stream sends each choice whole, once it is done",
    "length_penalty": "vLLM uses it in beam search only, which is refused",
    "return_token_offsets": "vLLM returns token offsets from its /render routes only",
    "mm_payload": "vLLM uses it on its /render routes only",
    "return_mm_kwargs": "vLLM's deprecated alias of mm_payload",
}
CHAT_IGNORED = {"parallel_tool_calls": "vLLM keeps the first of the tool calls its tool parser found; no parser "
                                       "here (tool_calls is always [])"}

SESSION_HEADER = "X-Session-Id"  # vLLM reads X-Session-ID: HTTP headers are case-insensitive
REQUEST_ID_HEADER, PRIORITY_HEADER = "X-Request-Id", "X-Vllm-Priority"  # vLLM's, over the body's fields


class StreamOptions(BaseModel):
    """vLLM's stream_options (its StreamOptions: other keys taken and unused, as OpenAIBaseModel's)."""

    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: Optional[bool] = False  # a last chunk with the whole request's usage
    # every chunk carries the usage so far (its prompt's tokens, its choice's tokens); with include_usage only
    continuous_usage_stats: Optional[bool] = False


def _means(value, accepted: tuple) -> bool:
    """`value` is one of `accepted`, type and all (0 is not False, -1.0 is not -1)."""
    return any(value is a or (type(value) is type(a) and value == a) for a in accepted)


class Sampling(BaseModel):
    """The fields both routes take (vLLM's names and defaults)."""

    # strict: JSON's true, 2.0 or "2" is no count and no token id (lax pydantic made them 1 and 2)
    model_config = ConfigDict(extra="allow", strict=True)
    REFUSED: ClassVar[dict] = REFUSED
    IGNORED: ClassVar[dict] = IGNORED
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
    stream_options: Optional[StreamOptions] = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    user: Optional[str] = None  # vLLM ignores it; here a session key (session_of)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = Field(None, ge=-1)
    truncation_side: Optional[Literal["left", "right"]] = None
    session_id: Optional[str] = None
    # the answer's id ("cmpl-<request_id>"), as vLLM's; echoed back, so bounded as a session id is
    request_id: Optional[str] = Field(None, max_length=MAX_ID_CHARS)
    # IGNORED
    stream_interval: Optional[int] = Field(None, ge=1)
    length_penalty: float = 1.0
    return_token_offsets: Optional[bool] = False
    mm_payload: Literal["tensors", "none"] = "tensors"
    return_mm_kwargs: Optional[bool] = None

    def check_supported(self, headers: Mapping) -> None:
        """ProtocolError naming the first field set that this server cannot honour (or a request
        id header longer than the body's field may be, or stream_options without stream, as vLLM refuses it)."""
        options = self.stream_options
        if options is not None and not self.stream and (options.model_fields_set or options.model_extra):
            raise ProtocolError(400, "Stream options can only be defined when `stream=True`.", "stream_options")
        header_id = headers.get(REQUEST_ID_HEADER)
        if header_id is not None and len(header_id) > MAX_ID_CHARS:
            raise ProtocolError(400, f"{REQUEST_ID_HEADER}: {len(header_id)} characters; at most {MAX_ID_CHARS}",
                                REQUEST_ID_HEADER)
        extra = dict(self.model_extra or {})
        try:  # vLLM's header, over the body's field (one that is no integer: ignored, as vLLM does)
            extra["priority"] = int(headers.get(PRIORITY_HEADER))
        except (TypeError, ValueError):
            pass
        for key, (accepted, why) in self.REFUSED.items():
            value = extra.get(key, accepted[0])
            if key == "vllm_xargs" and isinstance(value, dict):
                value = {k: v for k, v in value.items() if k != "session_id"}
            if not _means(value, accepted):
                shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
                why = f"; {why}" if why else ""
                raise ProtocolError(400, f"{key}={shown}: not supported by rollout_cluster{why}", key)

    def spec_fields(self, max_tokens: int, logprobs: Optional[int]) -> dict:
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

    def usage_in_stream(self) -> tuple[bool, bool]:
        """(a last usage chunk, usage on every chunk): vLLM's should_include_usage, which takes
        continuous_usage_stats only with include_usage."""
        options = self.stream_options
        if options is None:
            return False, False
        return bool(options.include_usage), bool(options.include_usage) and bool(options.continuous_usage_stats)

    def truncation(self, max_model_len: Optional[int], max_output_tokens: int) -> Optional[Truncation]:
        return truncation_of(self.truncate_prompt_tokens, self.truncation_side, max_model_len, max_output_tokens)

    def decoding(self) -> dict:
        """output_of's decoding flags (and min_tokens, within which no stop string ends a sample)."""
        return {"skip_special_tokens": self.skip_special_tokens,
                "spaces_between_special_tokens": self.spaces_between_special_tokens, "min_tokens": self.min_tokens}


def session_of(request: Request, body: Sampling) -> Optional[str]:
    """The multi-turn session a request is a turn of (router/sessions.py sends the session's turns
    to the replica that ran the previous one): vLLM's session id (its `session_id` field, else the
    X-Session-Id header, else `vllm_xargs.session_id`: the order vLLM reads them in), else OpenAI's `user`.
    A session id too long is refused naming where it came from; a `user` that is no session id (vLLM
    ignores it) only keeps the turn from affinity."""
    xargs = (body.model_extra or {}).get("vllm_xargs")
    from_xargs = xargs.get("session_id") if isinstance(xargs, dict) else None
    for value, name in ((body.session_id, "session_id"), (request.headers.get(SESSION_HEADER), SESSION_HEADER),
                        (from_xargs if isinstance(from_xargs, str) else None, "vllm_xargs.session_id")):
        if value:
            if len(value) > MAX_ID_CHARS:
                raise ProtocolError(400, f"{name}: {len(value)} characters; at most {MAX_ID_CHARS}", name)
            return value
    return body.user if body.user and len(body.user) <= MAX_ID_CHARS else None


def answer_id(request: Request, body: Sampling, prefix: str) -> str:
    """The answer's id as vLLM's: the X-Request-Id header, else the body's request_id, else random."""
    import uuid

    return f"{prefix}-{request.headers.get(REQUEST_ID_HEADER) or body.request_id or uuid.uuid4().hex}"


class CompletionBody(Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    add_special_tokens: bool = True  # the tokenizer's BOS and the like on a text prompt


ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class ChatBody(Sampling):
    REFUSED: ClassVar[dict] = {**REFUSED, **CHAT_REFUSED}
    IGNORED: ClassVar[dict] = {**IGNORED, **CHAT_IGNORED}
    messages: list[dict]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = 0
    # the name of one of the model's chat templates (transformers' named templates, "default" for a
    # model's one); a template's own text is refused by name (the model's templates are the ones rendered)
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict] = None
    tools: Optional[list] = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False  # on top of what the template writes (vLLM's chat default: none)
    reasoning_effort: Optional[ReasoningEffort] = None
    documents: Optional[list[dict[str, str]]] = None
    # IGNORED
    parallel_tool_calls: Optional[bool] = True

    def template_kwargs(self) -> dict:
        """What the chat template renders with besides the messages and add_generation_prompt, as
        vLLM's build_chat_params merges it: chat_template_kwargs, with the body's documents and
        reasoning_effort over them (where set), enable_thinking from reasoning_effort unless the
        kwargs say it, and the tools. add_generation_prompt and continue_final_message are the body's."""
        kwargs = {k: v for k, v in (self.chat_template_kwargs or {}).items()
                  if k not in ("add_generation_prompt", "continue_final_message")}
        if self.reasoning_effort is not None and "enable_thinking" not in kwargs:
            kwargs["enable_thinking"] = self.reasoning_effort != "none"
        kwargs.update({k: v for k, v in (("documents", self.documents), ("reasoning_effort", self.reasoning_effort))
                       if v is not None})
        if self.tools is not None:  # an empty list too: vLLM passes it, and transformers picks "tool_use"
            kwargs["tools"] = self.tools
        return kwargs


def parse_body(model: type, body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ProtocolError(400, f"body.{where}={shown(first.get('input'))}: {first['msg']}", f"body.{where}") from None


def check_model(ctx: ProtocolContext, name) -> None:
    if not ctx.names_model(name):
        raise ProtocolError(404, f"The model {shown(name)} does not exist. Valid: {ctx.model_name}", "model",
                            "NotFoundError")
