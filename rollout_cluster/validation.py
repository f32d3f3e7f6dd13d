"""What makes a request runnable: the one place its rules live.

`check_request` raises an InputError that names the field and the value. The router calls it on
every sequence it is given, with the engine's ModelInfo (vocabulary, context length); the driver's
expansion and the JSONL reader call it without one, so that a bad line or prompt is refused once,
before its `n` samples are made. A resumed partial rollout (`output_token_ids`) is checked here too:
it continues as a migrated sequence does, so what a migration cannot keep (presence and frequency
penalties count output tokens vLLM would not see) cannot be resumed either (docs/semantics.md).
"""
from __future__ import annotations

from typing import Optional

from .protocol import InputError, ModelInfo, SamplingSpec, SequenceRequest, is_int


def check_request(req: SequenceRequest, model: Optional[ModelInfo] = None) -> None:
    """Raise InputError naming the field if `req` cannot run; `model` adds the engine's limits."""
    if not isinstance(req.sampling, SamplingSpec):
        raise InputError("sampling", req.sampling, "must be a SamplingSpec")
    req.sampling.validate()
    check_prompt(req.prompt_token_ids)
    check_resumed_output(req, model)
    if model is None:
        return
    ids = req.prompt_token_ids
    if ids is not None:
        bad = next((t for t in ids if not 0 <= t < model.vocab_size), None)
        if bad is not None:
            raise InputError("prompt_token_ids", bad, f"token id outside the vocabulary [0, {model.vocab_size})")
    if req.prompt_len >= model.max_model_len:
        raise InputError("prompt_token_ids", f"<{req.prompt_len} tokens>",
                         f"prompt longer than the model's context (max_model_len={model.max_model_len})")
    if req.prompt_len + req.sampling.max_tokens > model.max_model_len:
        raise InputError("max_tokens", req.sampling.max_tokens,
                         f"prompt ({req.prompt_len}) + max_tokens exceeds max_model_len={model.max_model_len}")


def check_prompt(ids) -> None:
    """A prompt is a non-empty list of integer token ids (None: a simulated prompt of known length)."""
    if ids is None:
        return
    if not isinstance(ids, list) or not ids:
        raise InputError("prompt_token_ids", ids, "must be a non-empty list of token ids")
    bad = next((t for t in ids if not is_int(t)), None)
    if bad is not None:
        raise InputError("prompt_token_ids", bad, "every token id must be an integer")


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
    bad = next((t for t in out if not is_int(t)), None)
    if bad is not None:
        raise InputError("output_token_ids", bad, "every token id must be an integer")
    if model is not None:
        bad = next((t for t in out if not 0 <= t < model.vocab_size), None)
        if bad is not None:
            raise InputError("output_token_ids", bad, f"token id outside the vocabulary [0, {model.vocab_size})")
    if len(out) >= spec.max_tokens:
        raise InputError("output_token_ids", f"<{len(out)} tokens>",
                         f"nothing left to generate: max_tokens={spec.max_tokens} counts the resumed output")
    if not spec.migratable:
        raise InputError("output_token_ids", f"<{len(out)} tokens>",
                         "cannot resume a sample with presence_penalty or frequency_penalty: vLLM would not "
                         "count the resumed tokens")
    if spec.logprobs is None:
        if lps is not None:
            raise InputError("output_logprobs", f"<{len(lps) if isinstance(lps, list) else lps}>",
                             "given, but sampling.logprobs is null")
        return
    if not isinstance(lps, list) or len(lps) != len(out):
        shown = f"<{len(lps)} logprobs>" if isinstance(lps, list) else lps
        raise InputError("output_logprobs", shown,
                         f"sampling asks for logprobs: must be a list of {len(out)} numbers, one per output token")
    bad = next((x for x in lps if not isinstance(x, (int, float)) or isinstance(x, bool)), None)
    if bad is not None:
        raise InputError("output_logprobs", bad, "every logprob must be a number")
