"""The simulated engines' prefix cache (vLLM's `enable_prefix_caching`), one per engine.

The n samples of a prompt (a group) share its token ids. On a real replica only the first of
them to arrive pays the prompt's prefill; later siblings, and continuations of the group (prompt
+ partial output), find the prompt's KV blocks cached and prefill only the rest. The engines ask
`admit` on every admission and charge prefill for `context - hit` tokens.

Keys are `Work.prefix_key` (the group), each with its prompt length `Work.prefix_len`. A key is
*held* while a running sequence of the group holds the prompt's blocks: held keys are never
evicted (vLLM cannot free referenced blocks). When its last running sequence finishes, is
aborted or preempted, the key becomes *free*: still cached, in the free pool, in the order it
got there. vLLM reuses free blocks oldest first, so a free key is evicted (oldest first) once
the free keys' tokens plus the running context exceed the KV capacity (`evict`).

Simplifications, all of which make the cache at most as effective as vLLM's: only the
original prompt is cached (not generated tokens, so a preempted sequence recomputes its output,
and only its prompt comes free); siblings running together still each count their full context
in KV (vLLM shares the prompt's blocks); whole prompts hit, not 16-token blocks.
Pure: no clock; the two engines call it at the same points, so they stay equivalent.
"""
from __future__ import annotations

from collections import OrderedDict


class PrefixCache:
    __slots__ = ("capacity", "held", "free", "free_tokens", "hits", "hit_tokens", "evictions")

    def __init__(self, kv_tokens):
        self.capacity = kv_tokens
        self.held: dict = {}  # key -> running sequences holding it
        self.free: OrderedDict = OrderedDict()  # key -> prefix tokens, unreferenced, oldest first
        self.free_tokens = 0
        self.hits = 0
        self.hit_tokens = 0
        self.evictions = 0

    def admit(self, key, prefix_len: int) -> int:
        """A sequence of group `key` is admitted: the prompt tokens it finds cached (0 or
        prefix_len). Afterwards the key is cached and held."""
        held = self.held
        n = held.get(key)
        if n is not None:
            held[key] = n + 1
        else:
            held[key] = 1
            cached = self.free.pop(key, None)
            if cached is None:
                return 0  # miss: this admission prefills the prompt, which is cached from now on
            self.free_tokens -= cached
        self.hits += 1
        self.hit_tokens += prefix_len
        return prefix_len

    def release(self, key, prefix_len: int) -> None:
        """A running sequence of group `key` left the batch (finished, aborted, preempted)."""
        n = self.held[key] - 1
        if n:
            self.held[key] = n
        else:
            del self.held[key]
            self.free[key] = prefix_len
            self.free_tokens += prefix_len

    def evict(self, context: int) -> None:
        """Drop free keys, oldest first, while they and the running context overflow KV."""
        free = self.free
        while free and self.free_tokens + context > self.capacity:
            _, n = free.popitem(last=False)
            self.free_tokens -= n
            self.evictions += 1
