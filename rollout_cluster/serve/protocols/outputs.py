"""A completion back as a protocol's text: decoded, cut at the first stop string."""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate
from typing import Optional, Sequence

from ...protocol import Completion
from .context import ProtocolContext, ProtocolError


@dataclass
class Output:
    """One sample as a protocol returns it."""

    token_ids: list  # generated ids (cut after a stop string)
    logprobs: Optional[list]  # the sampled tokens' logprobs, aligned with token_ids
    text: str  # token_ids decoded ("" without a tokenizer)
    finish_reason: str  # "stop", "length" or "abort"
    stop_reason: object = None  # the stop string that ended it


def output_of(ctx: ProtocolContext, c: Completion, stops: list, include_stop: bool = False,
              skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
              prompt_ids: Sequence[int] = (), min_tokens: int = 0) -> Output:
    """A completion as text, cut at the first stop string (the engines run without detokenizer,
    so stop strings are applied here, on the whole output). `skip_special_tokens` and
    `spaces_between_special_tokens`: vLLM's, as its detokenizer applies them (codec.pieces).
    `prompt_ids`: the prompt it continues; its text is decoded after the prompt's, as vLLM's is.
    `min_tokens`: a stop string counts only where it ends past the first min_tokens tokens' text."""
    ids, logprobs = list(c.token_ids), (list(c.logprobs) if c.logprobs is not None else None)
    if ctx.codec is None:
        return Output(ids, logprobs, "", c.finish_reason)
    # vLLM's flag only tells when special tokens are kept: then two in a row join bare
    bare_specials = not skip_special_tokens and not spaces_between_special_tokens
    if stops or bare_specials:
        # The text a token at a time, then each stop searched once in the whole of it, as vLLM's
        # detokenizer (check_stop_strings) decides: the first token whose text completes a stop
        # cuts; of the stops it completes, the one that ends first in the text, then the first in
        # the request's list. Text that ends within the first min_tokens tokens is not searched
        # (vLLM's too). Searching the text so far after every token cost tokens^2 x stops.
        pieces = ctx.codec.pieces(ids, skip_special_tokens, spaces_between_special_tokens, prompt_ids)
        ends, text = list(accumulate(map(len, pieces))), "".join(pieces)
        searched = stops if min_tokens <= len(ends) else ()  # (min_tokens or fewer tokens: none ends it)
        floor = ends[min_tokens - 1] if 0 < min_tokens <= len(ends) else 0  # the first min_tokens' text
        hits = ((bisect_left(ends, at + len(s)), at + len(s), i, at, s) for i, s in enumerate(searched) if s
                for at in (text.find(s, max(0, floor - len(s) + 1)),) if at >= 0)
        hit = min(hits, default=None)
        if hit is not None:
            k, _, _, at, s = hit
            return Output(ids[:k + 1], logprobs[:k + 1] if logprobs is not None else None,
                          text[:at + len(s)] if include_stop else text[:at], "stop", s)
        if bare_specials:
            return Output(ids, logprobs, text, c.finish_reason)
    return Output(ids, logprobs, ctx.codec.decode(ids, skip_special_tokens, prompt_ids), c.finish_reason)


# Stop strings a request may give: each is searched in every output's text (vLLM sets no bound;
# OpenAI's API takes 4)
MAX_STOP_STRINGS = 256


def stops_of(ctx: ProtocolContext, value, param: str = "stop") -> list:
    """The request's stop strings. Without a tokenizer none can be applied: refused, as vLLM refuses
    stop strings it cannot detokenize for (it would silently run to max_tokens)."""
    stops = stop_list(value, param)
    if stops and ctx.codec is None:
        raise ProtocolError(400, f"{param}: stop strings need the model's tokenizer, which this app does not have "
                                 "(engine.tokenizer); use stop_token_ids", param)
    return stops


def stop_list(value, param: str = "stop") -> list:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        if any(not s for s in value):  # (as vLLM's SamplingParams refuses it: it would match everywhere)
            raise ProtocolError(400, f"{param}: must not contain an empty string", param)
        if len(value) > MAX_STOP_STRINGS:
            raise ProtocolError(400, f"{param}: {len(value)} stop strings; at most {MAX_STOP_STRINGS}", param)
        return value
    raise ProtocolError(400, f"{param}: must be a string or a list of strings", param)
