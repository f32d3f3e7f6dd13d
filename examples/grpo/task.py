"""The synthetic task: reverse the digit string in the prompt. Token ids only, no text tokenizer.

    prompt   = [BOS, d1, ..., dk, SEP]        k digits, k drawn from [min_digits, max_digits]
    response = [dk, ..., d1, EOS]             what earns the full reward

The reward is verifiable and dense: each position of the response that holds the right digit earns
1 / max(k, response digits), so a response that is too long or too short loses credit, and only
the exact reversal followed by EOS earns 1.0. Response lengths follow k, so a batch mixes short
and long samples (what partial rollouts are for).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

BOS = 1  # the served model's bos_token_id (models/tiny-llama)
EOS = 2  # its eos_token_id: vLLM stops there (and SamplingSpec.stop_token_ids names it)
DIGIT0 = 10  # digits 0..9 are token ids 10..19
SEP = 20  # ends the prompt: "now answer"
VOCAB_USED = 21  # ids the task uses; the model's other ids must learn never to appear


@dataclass(frozen=True)
class Task:
    min_digits: int = 2  # shortest digit string in a prompt
    max_digits: int = 8  # longest digit string in a prompt

    def __post_init__(self):
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"min_digits={self.min_digits}, max_digits={self.max_digits}: "
                             "need 1 <= min_digits <= max_digits")

    @property
    def max_response_tokens(self) -> int:
        """Room for a wrong answer three times the longest: a policy that has not learnt to stop
        rambles up to here (the long tail partial rollouts cut)."""
        return 3 * self.max_digits

    def sample_digits(self, rng: random.Random, max_digits: int | None = None) -> list[int]:
        k = rng.randint(self.min_digits, max_digits or self.max_digits)
        return [rng.randrange(10) for _ in range(k)]

    def prompts(self, rng: random.Random, count: int) -> list[list[int]]:
        return [prompt_ids(self.sample_digits(rng)) for _ in range(count)]


def prompt_ids(digits: list[int]) -> list[int]:
    return [BOS] + [DIGIT0 + d for d in digits] + [SEP]


def digits_of(prompt: list[int]) -> list[int]:
    """The digits a prompt made by prompt_ids holds."""
    if len(prompt) < 3 or prompt[0] != BOS or prompt[-1] != SEP:
        raise ValueError(f"prompt={prompt!r}: not [BOS, digits..., SEP]")
    return [t - DIGIT0 for t in prompt[1:-1]]


def target_ids(prompt: list[int]) -> list[int]:
    """The response that earns reward 1.0: the digits reversed, then EOS."""
    return [DIGIT0 + d for d in reversed(digits_of(prompt))] + [EOS]


def reward(prompt: list[int], response: list[int]) -> float:
    """Per-digit credit in [0, 1]: right digits in place / max(target length, response length);
    a response that does not end in EOS (cut at max_tokens) earns at most half."""
    target = target_ids(prompt)[:-1]
    ended = bool(response) and response[-1] == EOS
    body = response[:-1] if ended else response
    hits = sum(1 for a, b in zip(body, target) if a == b)
    score = hits / max(len(target), len(body))
    return score if ended else 0.5 * score


def exact(prompt: list[int], response: list[int]) -> bool:
    return list(response) == target_ids(prompt)
