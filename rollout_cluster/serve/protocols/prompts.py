"""A request's prompts and sampling into the batch's SequenceRequests, checked whole before anything
is submitted (vLLM refuses a bad request whole too): its prompts against the engine's vocabulary
and context, its sampling against vLLM's ranges and the config's `limits`."""
from __future__ import annotations

from typing import Optional

from ...client.expand import expand
from ...protocol import InputError, SamplingSpec, is_int
from ...text.codec import NoSuchTemplate, NoTokenizer
from ...text.content_format import content_format
from ...validation import check_request
from .chat_messages import template_messages
from .context import ProtocolContext, ProtocolError
from .truncation import Truncation


def prompt_ids(ctx: ProtocolContext, prompt, param: str, add_special_tokens: bool = True,
               truncation: Optional[Truncation] = None) -> list[int]:
    """A prompt as token ids: a string goes through the model's tokenizer, a list must hold ids;
    either cut as `truncation` says (vLLM's truncate_prompt_tokens)."""
    if isinstance(prompt, str):
        if ctx.codec is None:
            raise ProtocolError(400, f"{param}: the model has no tokenizer (tokenizer.json): send token ids", param)
        if not prompt:
            raise ProtocolError(400, f"{param}: must not be empty", param)
        return ctx.encode(prompt, param, add_special_tokens, truncation)
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return list(prompt) if truncation is None else truncation.ids(list(prompt))
    raise ProtocolError(400, f"{param}: must be a non-empty string or a non-empty list of token ids", param)


def chat_prompt(ctx: ProtocolContext, messages, param: str, template_kwargs: Optional[dict] = None,
                add_special_tokens: bool = False, truncation: Optional[Truncation] = None,
                add_generation_prompt: bool = True, template_name: Optional[str] = None) -> list[int]:
    """A conversation's prompt through the model's chat template, as token ids: the template named
    `template_name` (the request's `chat_template`), else the one transformers picks (codec.py:
    "tool_use" with tools, "default" without); its messages as vLLM hands them to the template
    (chat_messages.py: tool calls' arguments parsed, text parts joined, or kept as parts for a
    template that loops over them: vLLM's "auto" content format), the rendered text tokenized
    without the tokenizer's special tokens unless `add_special_tokens` (vLLM's chat default: the
    template writes them), cut as `truncation` says."""
    if ctx.codec is None:
        raise ProtocolError(400, f"{param}: the model has no tokenizer (tokenizer.json), so no chat", param)
    kwargs = dict(template_kwargs or {})
    for key in ("chat_template", "tokenize"):  # vLLM refuses them too (resolve_chat_template_kwargs)
        if key in kwargs:
            raise ProtocolError(400, f"chat_template_kwargs.{key}={kwargs[key]!r:.80}: not a template variable "
                                     "(a request names the model's template with its chat_template)",
                                f"chat_template_kwargs.{key}")
    try:
        template = ctx.codec.template_source(template_name, kwargs.get("tools") is not None)
    except NoTokenizer as e:
        raise ProtocolError(400, f"{param}: {e}", param) from None
    except NoSuchTemplate as e:
        raise ProtocolError(400, str(e), "chat_template") from None
    messages = template_messages(messages, param, template, content_format(template))
    try:
        text = ctx.codec.render_chat(messages, add_generation_prompt, template_name, **kwargs)
    except Exception as e:  # the template raised (raise_exception) or did not render
        raise ProtocolError(400, f"{param}: the chat template refused it: {e}", param) from None
    return ctx.encode(text, param, add_special_tokens, truncation)


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


def check_count(ctx: ProtocolContext, prompts: int, n: int, field: str = "prompt") -> None:
    """`prompts` prompts x `n` samples within the config's limits, or ProtocolError naming `field`
    (the request's prompts). Before any prompt is tokenized: counting needs no tokenizer, and a
    body of millions of short prompts would hold the event loop for minutes before the refusal."""
    limits = ctx.limits
    if n > limits.max_n:
        raise ProtocolError(400, f"n={n}: at most limits.max_n={limits.max_n} samples per prompt", "n")
    if prompts * n > limits.max_batch_sequences:
        raise ProtocolError(400, f"{prompts} prompts x n={n}: at most limits.max_batch_sequences="
                                 f"{limits.max_batch_sequences} sequences a request", field)


async def checked_requests(ctx: ProtocolContext, prompts: list, spec: SamplingSpec,
                           session: Optional[str] = None, field: str = "prompt") -> list:
    """The batch's SequenceRequests (prompt-major), every one checked against the engine's limits.
    `session`: the multi-turn session every prompt of the request is a turn of (session affinity).
    `field`: the request's prompts (named by a refusal of their count)."""
    check_count(ctx, len(prompts), spec.n, field)
    requests = expand(prompts, spec, sessions=None if session is None else [session] * len(prompts))
    model = await ctx.model_info()
    for req in requests[::spec.n]:
        try:
            check_request(req, model)
        except InputError as e:
            where = f" (prompt {req.prompt_index})" if len(prompts) > 1 else ""
            raise ProtocolError(400, f"{e}{where}", e.field) from None
    return requests
