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
count output tokens that vLLM would not see, so such a sample is refused (validation.py).
"""
from __future__ import annotations

from array import array
from .protocol import SequenceRequest


def resumed_state(req: SequenceRequest, record_tokens: bool) -> tuple:
    """(generated, token_ids, logprobs) a sequence starts from: its resumed output, checked."""
    out = req.output_token_ids
    if not out:
        return 0, array("i"), None
    if not record_tokens:  # the simulator counts tokens without keeping them
        return len(out), array("i"), None
    lps = array("d", req.output_logprobs) if req.sampling.logprobs is not None else None
    return len(out), array("i", out), lps
