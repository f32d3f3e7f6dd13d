"""What makes a request runnable: the one place its rules live.

`check_request` raises an InputError that names the field and the value. The router calls it on
every sequence it is given, with the engine's ModelInfo (vocabulary, context length); the driver's
expansion and the JSONL reader call it without one, so that a bad line or prompt is refused once,
before its `n` samples are made. A resumed partial rollout (`output_token_ids`) is checked here too:
it continues as a migrated sequence does, so what a migration cannot keep (presence and frequency
penalties count output tokens vLLM would not see) cannot be resumed either (docs/semantics.md).

A request that passes is runnable: the router registers it and builds its state (token ids in
32-bit arrays, logprobs in doubles) without another check, so every value that state holds is
checked here: token ids are integers in [0, 2**31) (vLLM's are int32), resumed logprobs finite
numbers <= 0, the indices integers. With the engine's ModelInfo, its vocabulary, context length,
max_logprobs and highest temperature bound them too.
"""
from __future__ import annotations

from typing import Optional

from .protocol import InputError, ModelInfo, SamplingSpec, SequenceRequest, is_int, is_number

TOKEN_ID_END = 2**31  # vLLM's token ids are int32, and the router keeps them in array("i")


def check_request(req: SequenceRequest, model: Optional[ModelInfo] = None) -> None:
    """Raise InputError naming the field if `req` cannot run; `model` adds the engine's limits."""
    if not isinstance(req.sampling, SamplingSpec):
        raise InputError("sampling", req.sampling, "must be a SamplingSpec")
    req.sampling.validate()
    check_session(getattr(req, "session", None))
    check_prompt(req.prompt_token_ids)
    check_positions(req)
    check_resumed_output(req, model)
    if model is None:
        return
    ids = req.prompt_token_ids
    if ids is not None:
        bad = _first(ids, lambda t: t < model.vocab_size)
        if bad is not None:
            raise InputError("prompt_token_ids", bad[1], f"token id outside the vocabulary [0, {model.vocab_size})")
    spec = req.sampling
    # (vLLM indexes the logits by them: one past the vocabulary is a device-side fault that kills the engine)
    bad = _first(list(spec.stop_token_ids or ()), lambda t: t < model.vocab_size)
    if bad is not None:
        raise InputError("stop_token_ids", bad[1], f"token id outside the vocabulary [0, {model.vocab_size})")
    limit = model.max_logprobs if model.max_logprobs >= 0 else model.vocab_size  # vLLM: -1 is the vocabulary
    if spec.logprobs is not None and spec.logprobs > limit:
        raise InputError("logprobs", spec.logprobs, f"must be at most the engine's max_logprobs={limit}")
    if model.max_temperature is not None and spec.temperature > model.max_temperature:
        raise InputError("temperature", spec.temperature, f"must be at most {model.max_temperature:g} "
                                                          "(the engine's vLLM refuses more)")
    if req.prompt_len >= model.max_model_len:
        raise InputError("prompt_token_ids", f"<{req.prompt_len} tokens>",
                         f"prompt longer than the model's context (max_model_len={model.max_model_len})")
    if req.prompt_len + req.sampling.max_tokens > model.max_model_len:
        raise InputError("max_tokens", req.sampling.max_tokens,
                         f"prompt ({req.prompt_len}) + max_tokens exceeds max_model_len={model.max_model_len}")


MAX_SESSION_CHARS = 256


def check_session(session) -> None:
    if session is not None and (not isinstance(session, str) or not 0 < len(session) <= MAX_SESSION_CHARS):
        raise InputError("session", session, f"must be null or a string of 1 to {MAX_SESSION_CHARS} characters")


def _first(values: list, ok) -> Optional[tuple]:
    """(index, value) of the first value that is not `ok`, or None (a bad value may be None itself)."""
    return next(((i, v) for i, v in enumerate(values) if not ok(v)), None)


def _token_id(t) -> bool:
    return is_int(t) and 0 <= t < TOKEN_ID_END


def _token_ids(name: str, ids) -> None:
    bad = _first(ids, _token_id)
    if bad is not None:
        why = "every token id must be an integer" if not is_int(bad[1]) else f"token id outside [0, {TOKEN_ID_END})"
        raise InputError(name, bad[1], f"{why} (at index {bad[0]})")


def check_prompt(ids) -> None:
    """A prompt is a non-empty list of integer token ids (None: a simulated prompt of known length)."""
    if ids is None:
        return
    if not isinstance(ids, list) or not ids:
        raise InputError("prompt_token_ids", ids, "must be a non-empty list of token ids")
    _token_ids("prompt_token_ids", ids)


def check_place(req: SequenceRequest, where: str = "") -> None:
    """The request's place in its batch (the router keys its group by prompt_index)."""
    for name in ("prompt_index", "sample_index"):
        value = getattr(req, name)
        if not is_int(value) or value < 0:
            raise InputError(where + name, value, "must be an integer >= 0")


def check_positions(req: SequenceRequest) -> None:
    """The request's place, and the lengths the router and the policy compute with."""
    check_place(req)
    ids = req.prompt_token_ids
    if not is_int(req.prompt_len) or req.prompt_len < 0 or (ids is not None and req.prompt_len != len(ids)):
        raise InputError("prompt_len", req.prompt_len, "must be the prompt's length")
    if req.hidden_length is not None and (not is_int(req.hidden_length) or req.hidden_length < 0):
        raise InputError("hidden_length", req.hidden_length, "must be null or an integer >= 0")


def check_resumed_output(req: SequenceRequest, model: Optional[ModelInfo]) -> None:
    """A resumed partial rollout's output must be continuable: token ids (in the vocabulary),
    something left to generate, no output-counting penalty, and one logprob a token if asked."""
    out, lps, spec = req.output_token_ids, req.output_logprobs, req.sampling
    if out is None:
        if lps is not None:
            raise InputError("output_logprobs", lps, "given without output_token_ids")
        return
    if not isinstance(out, list) or not out:
        raise InputError("output_token_ids", out, "must be null or a non-empty list of token ids")
    _token_ids("output_token_ids", out)
    if model is not None:
        bad = _first(out, lambda t: t < model.vocab_size)
        if bad is not None:
            raise InputError("output_token_ids", bad[1], f"token id outside the vocabulary [0, {model.vocab_size})")
    if len(out) >= spec.max_tokens:
        raise InputError("output_token_ids", f"<{len(out)} tokens>",
                         f"nothing left to generate: max_tokens={spec.max_tokens} counts the resumed output")
    if not spec.migratable:
        raise InputError("output_token_ids", f"<{len(out)} tokens>",
                         "cannot resume a sample with presence_penalty or frequency_penalty: vLLM would not "
                         "count the resumed tokens")
    if spec.logprobs is None:
        if lps is not None:
            raise InputError("output_logprobs", f"<{len(lps)}>" if isinstance(lps, list) else lps,
                             "given, but sampling.logprobs is null")
        return
    if not isinstance(lps, list) or len(lps) != len(out):
        shown = f"<{len(lps)} logprobs>" if isinstance(lps, list) else lps
        raise InputError("output_logprobs", shown,
                         f"sampling asks for logprobs: must be a list of {len(out)} numbers, one per output token")
    bad = _first(lps, lambda x: is_number(x) and x <= 0)  # a log-probability: finite, and <= 0
    if bad is not None:
        raise InputError("output_logprobs", bad[1], f"every logprob must be a finite number <= 0 (at index {bad[0]})")
