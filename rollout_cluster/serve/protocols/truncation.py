"""vLLM's `truncate_prompt_tokens` and `truncation_side` (its renderers/params.py TokenizeParams):
a prompt cut to its last (or first) tokens before it runs, on the text and token-id prompts of
/v1/completions and the rendered prompt of /v1/chat/completions."""
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
