"""Prompts and sampling specs into SequenceRequests: one per (prompt, sample), in input order.

What makes a request runnable is validation.py's to say, and the router asks it of every
sequence: a prompt that cannot run comes back as n error completions naming the field, one per
sample, so that the results keep their shape (one per prompt and sample). Only an invalid `n`
yields a single request. (The JSONL reader refuses a bad line once, as one error line.)
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

from ..protocol import MAX_N, InputError, Partial, SamplingSpec, SequenceRequest, is_int


def expand(prompts: Sequence, sampling: Union[SamplingSpec, Sequence[SamplingSpec]],
           hidden_lengths: Optional[Sequence] = None, sessions: Optional[Sequence] = None) -> list:
    """One SequenceRequest per (prompt, sample), in input order. A prompt whose n is invalid (n < 1,
    say) yields one request carrying the error, so it comes back as one error completion.
    A `Partial` among the prompts is one sample, whatever its spec's n: it continues after its tokens.
    `sessions`: one multi-turn session id (or None) per prompt, for session affinity. `prompts` may
    be any iterable of prompts (a generator is taken whole), not a string or a mapping."""
    if isinstance(prompts, (str, bytes, dict)) or not hasattr(prompts, "__iter__"):
        raise InputError("prompts", prompts, "must be a list of prompts (token-id lists or Partials)")
    if not hasattr(prompts, "__len__"):
        prompts = list(prompts)
    if not isinstance(sampling, SamplingSpec) and (isinstance(sampling, (str, bytes)) or not hasattr(sampling, "__len__")):
        raise InputError("sampling", sampling, "must be a SamplingSpec, or a list of them, one per prompt")
    if sessions is not None and not isinstance(sessions, str) and not hasattr(sessions, "__len__"):
        raise InputError("sessions", sessions, "must be a list of session ids (or None), one per prompt")
    specs = [sampling] * len(prompts) if isinstance(sampling, SamplingSpec) else list(sampling)
    if len(specs) != len(prompts):
        raise InputError("sampling", f"<{len(specs)} specs>", f"needs one spec per prompt ({len(prompts)})")
    if sessions is not None and (isinstance(sessions, str) or len(sessions) != len(prompts)):
        raise InputError("sessions", f"<{len(sessions)} sessions>" if not isinstance(sessions, str) else sessions,
                         f"needs one session id (or None) per prompt ({len(prompts)})")
    if hidden_lengths is not None and (isinstance(hidden_lengths, (str, bytes)) or not hasattr(hidden_lengths, "__len__")
                                       or not hasattr(hidden_lengths, "__getitem__")):
        raise InputError("hidden_lengths", hidden_lengths, "must be a list of lengths, one per (prompt, sample) pair")
    out = []
    for i, (prompt, spec) in enumerate(zip(prompts, specs)):
        def hidden():
            if hidden_lengths is None:
                return None
            if len(out) >= len(hidden_lengths):
                raise _hidden_refused(hidden_lengths, "is shorter than the (prompt, sample) pairs")
            return hidden_lengths[len(out)]

        start = len(out)
        if isinstance(prompt, Partial):
            out.append(_resumed_request(prompt, spec, i, hidden()))
        else:
            first = _request(prompt, spec, i, 0, hidden())
            out.append(first)
            for j in range(1, _samples(first)):
                out.append(_request(prompt, spec.for_sample(j) if isinstance(spec, SamplingSpec) else spec, i, j,
                                    hidden()))
        if sessions is not None:
            for req in out[start:]:
                req.session = sessions[i]
    if hidden_lengths is not None and len(hidden_lengths) != len(out):
        raise _hidden_refused(hidden_lengths, f"has more values than the {len(out)} (prompt, sample) pairs")
    return out


def _hidden_refused(hidden_lengths, what: str) -> InputError:
    return InputError("hidden_lengths", f"<{len(hidden_lengths)} values>",
                      f"{what}: it needs one length per (prompt, sample) pair, in the order they expand")


def _samples(first: SequenceRequest) -> int:
    """A prompt's n samples, each refused on its own if the prompt cannot run (so that a trainer
    gets n results for every prompt); 1 where n itself is invalid (validation.py names it), as
    past MAX_N, so that no n makes more requests than a batch may hold."""
    n = getattr(first.sampling, "n", None)
    return n if is_int(n) and 1 <= n <= MAX_N else 1


def _request(prompt, spec: SamplingSpec, index: int, sample: int, hidden: Optional[int]) -> SequenceRequest:
    ids = list(prompt) if isinstance(prompt, (list, tuple)) else prompt
    if isinstance(ids, list):
        return SequenceRequest(ids, spec, index, sample, hidden, prompt_len=len(ids))
    req = SequenceRequest([], spec, index, sample, hidden, prompt_len=0)
    req.prompt_token_ids = ids  # not a token list: the router refuses it, naming the field
    return req


def _resumed_request(p: Partial, spec: SamplingSpec, index: int, hidden: Optional[int]) -> SequenceRequest:
    """A Partial's one request: a sample cut off before its first token starts afresh."""
    ids = list(p.prompt_token_ids) if isinstance(p.prompt_token_ids, (list, tuple)) else p.prompt_token_ids
    tokens = list(p.token_ids) if isinstance(p.token_ids, (list, tuple)) else p.token_ids
    logprobs = list(p.logprobs) if isinstance(p.logprobs, (list, tuple)) else p.logprobs
    if tokens == []:
        tokens = logprobs = None
    sample = p.sample_index
    if isinstance(spec, SamplingSpec) and is_int(sample) and sample > 0:
        spec = spec.for_sample(sample)  # seeded as the sample it was
    return SequenceRequest(ids, spec, index, 0, hidden, prompt_len=len(ids) if isinstance(ids, list) else 0,
                           output_token_ids=tokens, output_logprobs=logprobs)
