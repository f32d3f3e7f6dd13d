"""vLLM's `truncate_prompt_tokens` and `truncation_side` (its renderers/params.py TokenizeParams):
a prompt cut to its last (or first) tokens before it runs, on the text and token-id prompts of
/v1/completions and the rendered prompt of /v1/chat/completions; and the older SamplingParams
field of that name that TRL 0.25-0.29's /generate/ and /chat/ pass on (sampling_truncation_of)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .context import ProtocolError


@dataclass(frozen=True)
class Truncation:
    """How a prompt is cut, resolved against the model's context."""

    keep: int  # the most tokens the prompt keeps (0: none, which is then refused as an empty prompt)
    # "left" drops the start (keeps the last `keep`), "right" the end; None: the tokenizer's own cut,
    # from the left (vLLM loads a generative model's tokenizer with truncation_side="left"), which keeps
    # room for its special tokens (a BOS stays) where an explicit "left" slices the ids
    side: Optional[str]

    def ids(self, ids: list) -> list:
        if self.keep >= len(ids):
            return ids
        if self.keep == 0:
            return []
        return ids[:self.keep] if self.side == "right" else ids[-self.keep:]


def truncation_of(keep: Optional[int], side: Optional[str], max_model_len: Optional[int],
                  max_output_tokens: int) -> Optional[Truncation]:
    """The request's Truncation, or None; ProtocolError naming truncate_prompt_tokens when it is
    more than the context, as vLLM refuses it. -1: the context, less a token for the output when the
    request asks for any (vLLM's max_truncation_tokens), so the prompt still leaves room to generate."""
    if keep is None:  # truncation_side alone cuts nothing (vLLM)
        return None
    if max_model_len is not None and keep > max_model_len:
        raise ProtocolError(400, f"truncate_prompt_tokens={keep} cannot be greater than max_model_len = "
                                 f"{max_model_len}. Please request a smaller truncation size.",
                            "truncate_prompt_tokens")
    if keep < 0:
        if max_model_len is None:  # no replica said the context yet: nothing to resolve -1 against
            return None
        keep = max_model_len if max_output_tokens == 0 else max(0, max_model_len - 1)
    return Truncation(keep, side)


def sampling_truncation_of(keep: Optional[int], max_model_len: Optional[int],
                           max_output_tokens: int) -> Optional[Truncation]:
    """TRL 0.25-0.29's `truncate_prompt_tokens` (trl vllm-serve put it in vLLM's SamplingParams; vLLM
    0.10.2-0.12, the ones those TRLs take, cut as their LLM class cut): the last `keep` tokens, by the
    tokenizer's own left cut (a BOS stays) for a text, sliced for token ids and a rendered chat; 0 or
    below -1 refused (SamplingParams), more than the context refused (_validate_truncation_size).
    -1: the context less a token for the output, as truncation_of resolves it. vLLM 0.12 kept the
    whole context and sampled one token; the engines here (as vLLM's today) refuse a prompt that
    fills the context, so the cut leaves room for that token."""
    if keep is not None and (keep == 0 or keep < -1):
        raise ProtocolError(400, f"truncate_prompt_tokens={keep}: must be an integer >= 1 or -1",
                            "truncate_prompt_tokens")
    return truncation_of(keep, None, max_model_len, max_output_tokens)
