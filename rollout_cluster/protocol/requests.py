"""Driver -> router: what to generate. SamplingSpec (per-prompt sampling parameters, checked
against vLLM's own ranges) and SequenceRequest (one sample of one prompt).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Optional

from .checks import MAX_N, InputError, is_int64, is_number

# A cache salt's characters, at most: every sequence of a request carries it to the engine (and
# through each migration); bounded as a session id is (validation.MAX_SESSION_CHARS)
MAX_CACHE_SALT_CHARS = 256
LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # (a valid pair is one character in a str: any left is alone)


@dataclass(frozen=True)
class SamplingSpec:
    """Per-prompt sampling parameters; `n` samples share a group id."""

    n: int = 1
    max_tokens: int = 128
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability (0: disabled); per step, so exact across migration
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # None: no logprobs; k>=0: logprob of the sampled token (+k top)
    stop_token_ids: tuple = ()
    seed: Optional[int] = None
    repetition_penalty: float = 1.0  # counts prompt+output: exact across migration
    presence_penalty: float = 0.0  # counts output only: pins the sequence
    frequency_penalty: float = 0.0  # counts output only: pins the sequence
    # vLLM's prefix-cache namespace: a request reuses cached KV only from requests with the same
    # salt (tenants that must not share a cache; a run that must not reuse earlier KV)
    cache_salt: Optional[str] = None

    def validate(self) -> None:
        """Raise InputError naming the first field outside vLLM's own range (SamplingParams would
        refuse it inside the engine, after the router took the request) or of the wrong type."""
        if not is_int64(self.n) or self.n < 1:
            raise InputError("n", self.n, "must be an integer >= 1")
        if self.n > MAX_N:
            raise InputError("n", self.n, f"must be at most {MAX_N} (limits.max_n may lower it)")
        if not is_int64(self.max_tokens) or self.max_tokens < 1:
            raise InputError("max_tokens", self.max_tokens, "must be an integer >= 1")
        if not is_int64(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InputError("min_tokens", self.min_tokens, "must be an integer in [0, max_tokens]")
        if not is_number(self.temperature) or self.temperature < 0:
            raise InputError("temperature", self.temperature, "must be a finite number >= 0")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InputError("top_p", self.top_p, "must be a number in (0, 1]")
        if not is_int64(self.top_k) or self.top_k < -1:
            raise InputError("top_k", self.top_k, "must be an integer >= -1 (0 or -1: disabled)")
        if not is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InputError("min_p", self.min_p, "must be a number in [0, 1]")
        if not isinstance(self.ignore_eos, bool):
            raise InputError("ignore_eos", self.ignore_eos, "must be true or false")
        if self.logprobs is not None and (not is_int64(self.logprobs) or self.logprobs < 0):
            raise InputError("logprobs", self.logprobs, "must be null or an integer >= 0")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise InputError("stop_token_ids", self.stop_token_ids, "must be a list of integers >= 0")
        for t in self.stop_token_ids:
            if not is_int64(t) or t < 0:
                raise InputError("stop_token_ids", t, "every stop token id must be an integer >= 0")
        if self.seed is not None and not is_int64(self.seed):
            raise InputError("seed", self.seed, "must be null or an integer in [-2**63, 2**63)")
        if not is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InputError("repetition_penalty", self.repetition_penalty, "must be a finite number > 0")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_number(value) or not -2 <= value <= 2:
                raise InputError(name, value, "must be a number in [-2, 2]")
        salt = self.cache_salt
        if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
            raise InputError("cache_salt", salt,
                             f"must be null or a string of 1 to {MAX_CACHE_SALT_CHARS} characters")
        if salt is not None and LONE_SURROGATE.search(salt):  # (vLLM's msgpack to its EngineCore cannot encode it)
            raise InputError("cache_salt", salt, "must be valid Unicode text (it holds a lone UTF-16 surrogate)")

    @property
    def migratable(self) -> bool:
        """False where vLLM cannot be given the output-so-far state (DESIGN: pinned)."""
        return self.presence_penalty == 0 and self.frequency_penalty == 0

    def for_sample(self, j: int) -> "SamplingSpec":
        """The spec of the prompt's sample `j`: with a seed, seed + j (wrapped within 64 bits), as
        vLLM seeds the j-th child of an n > 1 request; one seed for all n would make the n samples
        one sample n times."""
        if self.seed is None or j == 0 or not is_int64(self.seed):
            return self
        return replace(self, seed=(self.seed + j + 2**63) % 2**64 - 2**63)

    def for_continuation(self, generated: int) -> "SamplingSpec":
        """The spec of a segment that continues after `generated` tokens."""
        return replace(
            self,
            n=1,
            max_tokens=self.max_tokens - generated,
            min_tokens=max(0, self.min_tokens - generated),
            seed=None if self.seed is None else self.seed + generated,
        )


@dataclass
class SequenceRequest:
    """One sample to generate: a prompt's sample `sample_index`."""

    prompt_token_ids: list
    sampling: SamplingSpec
    prompt_index: int
    sample_index: int
    # Benchmarks only: the true response length. Only the engine adapter acts on it (it stops
    # the sequence there); the policy never reads it.
    hidden_length: Optional[int] = None
    # Simulation may omit the token ids and give only their number.
    prompt_len: int = -1
    # A partial rollout resumed (Partial): the tokens this sample generated in an earlier batch that
    # was cut off (generate's finish_fraction), and their logprobs. It continues after them, as a
    # migrated sequence does; `sampling.max_tokens` counts them, and its Completion starts with them.
    output_token_ids: Optional[list] = None
    output_logprobs: Optional[list] = None
    # A multi-turn session this request is a turn of (an agent's conversation): the router prefers
    # the replica that ran the session's previous turn, whose prefix cache holds the shared prefix.
    session: Optional[str] = None

    def __post_init__(self):
        if self.prompt_len < 0:
            self.prompt_len = len(self.prompt_token_ids)
