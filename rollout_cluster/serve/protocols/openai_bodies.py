"""The bodies of the OpenAI-compatible routes (vLLM's names and defaults), parsed strictly; the
fields vLLM's server takes that this one cannot honour, refused by name when set."""
from __future__ import annotations

from typing import Optional, Union

from fastapi import Request
from pydantic import BaseModel, ConfigDict, ValidationError

from .context import ProtocolContext, ProtocolError

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


def parse_body(model: type, body: dict):
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ProtocolError(400, f"body.{where}={first.get('input')!r}: {first['msg']}", f"body.{where}") from None


def check_model(ctx: ProtocolContext, name) -> None:
    if not ctx.names_model(name):
        raise ProtocolError(404, f"The model `{name}` does not exist. Valid: {ctx.model_name}", "model",
                            "NotFoundError")
