"""Partial rollouts: a sample cut off in one batch continues in a later one.

RL steps need not wait for their longest samples (Kimi k1.5's partial rollouts, APRIL): generate
with `finish_fraction` cancels the batch once that share of it is done, and the samples still
running come back with finish_reason "abort" and every token (and logprob) so far. A later batch
takes them as `Partial`s: each becomes a SequenceRequest whose `output_token_ids` the router
treats as a migrated sequence's partial output. The first segment's prompt is prompt + output,
`max_tokens` shrinks by the output's length, and the Completion starts with the output
(`resumed_tokens` of it). With greedy decoding, a resumed sample's tokens are exactly those of an
uncut run (tests/e2e/test_partial_rollouts_vllm.py).

What a resumed sample cannot keep is what a migration cannot: presence and frequency penalties
count output tokens that vLLM would not see, so such a sample is refused here (DESIGN: pinned).
"""
from __future__ import annotations

from array import array
from typing import Optional

from .protocol import InputError, ModelInfo, SequenceRequest, is_int


def check_output(req: SequenceRequest, model: Optional[ModelInfo]) -> None:
    """Raise InputError naming the field if `req`'s resumed output cannot be continued."""
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


def resumed_state(req: SequenceRequest, record_tokens: bool) -> tuple:
    """(generated, token_ids, logprobs) a sequence starts from: its resumed output, checked."""
    out = req.output_token_ids
    if not out:
        return 0, array("i"), None
    if not record_tokens:  # the simulator counts tokens without keeping them
        return len(out), array("i"), None
    lps = array("d", req.output_logprobs) if req.sampling.logprobs is not None else None
    return len(out), array("i", out), lps
