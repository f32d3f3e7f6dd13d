"""The simulated engines' prefix cache (vLLM's `enable_prefix_caching`), one per engine.

Two kinds of entries, both plain token counts under a key:

* the group's prompt, key `Work.prefix_key`, length `Work.prefix_len`. The n samples of a
  prompt (a group) share its token ids: on a replica only the first of them to arrive pays the
  prompt's prefill; later siblings, and continuations of the group, find it cached.
* a sequence's own context, key `seq_key(Work.seq_id)`, length the sequence's context when it
  left the batch (prompt + everything generated so far). vLLM keeps the KV blocks of a request's
  generated tokens after it ends (finished, aborted, preempted): they go to the free pool and
  stay until reused. So a continuation of the sequence (prompt + partial output: a `chunked`
  round, a migration back to the replica it last ran on, a preempted sequence coming back) finds
  its own context cached on that replica and prefills only what is missing.

The engines ask `admit` on every admission and charge prefill for `context - hit` tokens, where
the hit is the larger of the group's prompt (if cached) and the sequence's own cached context
(capped at the context being admitted). `release` is called whenever a running sequence leaves
the batch (finished, aborted, given up, preempted).

A group key is *held* while a running sequence of the group holds the prompt's blocks: held
keys are never evicted (vLLM cannot free referenced blocks). When its last running sequence
leaves, the key becomes *free*: still cached, in the free pool, in the order it got there. A
sequence key is free from its release until it is admitted again (then it is part of the
running context: popped from the pool) or evicted. vLLM reuses free blocks oldest first, so
free entries of both kinds are evicted together, oldest first, once the free entries' tokens
plus the running context exceed the KV capacity (`evict`). A finished sequence's entry is never
hit again but occupies free KV until evicted, as in vLLM.

Preemption: the engines preempt only when the running context fills the KV, and by then
`evict` has all but emptied the free pool (free tokens + running context <= capacity after every
admission and at every run's peak). A preempted sequence's context moves from the running
context to the free pool, which keeps that sum, so caching it contradicts no KV accounting; the
running sequences then grow into that space and evict it (oldest first, after older entries).
So a preempted sequence still recomputes its whole context, unless it is re-admitted before its
entry is evicted (a running sequence finished and freed room first), when it hits it, as vLLM's
recompute preemption does with prefix caching on.

Simplifications: entries are whole (a hit counts every token, where vLLM hits full 16-token
blocks only; eviction drops a whole entry, where vLLM evicts a request's tail blocks first and
may keep its head, e.g. a preempted sequence's); siblings running
together each count their full context in KV (vLLM shares the prompt's blocks); a released
sequence's entry counts its full context, prompt included, next to its group's prompt entry
(vLLM keeps one copy), so the free pool fills and evicts sooner than vLLM's: under KV pressure a
group's prompt can be evicted earlier than before sequences' contexts were cached. In exchange a
sequence's entry is self-contained: it still hits after its group's entry is evicted (in vLLM
the two are the same blocks, evicted together). Except the block rounding (under 16 tokens a hit)
and that last point, these make the cache less effective than vLLM's.
Pure: no clock; the two engines call it at the same points, so they stay equivalent.
"""
from __future__ import annotations

from collections import OrderedDict


def seq_key(seq_id) -> tuple:
    """The cache key of a sequence's own context (distinct from any group key)."""
    return ("seq", seq_id)


class PrefixCache:
    __slots__ = ("capacity", "held", "free", "free_tokens", "hits", "hit_tokens", "seq_hits", "seq_hit_tokens",
                 "evictions")

    def __init__(self, kv_tokens):
        self.capacity = kv_tokens
        self.held: dict = {}  # group key -> running sequences holding it
        self.free: OrderedDict = OrderedDict()  # key -> cached tokens, unreferenced, oldest first
        self.free_tokens = 0
        self.hits = 0  # admissions that found anything cached
        self.hit_tokens = 0  # tokens they found (the larger of group prompt and own context)
        self.seq_hits = 0  # ... of which the sequence's own context was the larger
        self.seq_hit_tokens = 0
        self.evictions = 0

    def admit(self, key, prefix_len: int, seq=None, context: int = 0) -> int:
        """A sequence is admitted with `context` tokens to prefill: `key`/`prefix_len` its
        group and prompt length (key None: no group), `seq` its own key (`seq_key`, None: not
        tracked). Returns the tokens it finds cached. Afterwards the group key is cached and
        held, and the sequence's own entry is no longer in the free pool."""
        hit = 0
        if key is not None:
            held = self.held
            n = held.get(key)
            if n is not None:
                held[key] = n + 1
                hit = prefix_len
            else:
                held[key] = 1
                cached = self.free.pop(key, None)
                if cached is not None:
                    self.free_tokens -= cached
                    hit = prefix_len
                # else miss: this admission prefills the prompt, which is cached from now on
        if seq is not None:
            cached = self.free.pop(seq, None)
            if cached is not None:
                self.free_tokens -= cached
                own = cached if cached < context else context
                if own > hit:
                    hit = own
                    self.seq_hits += 1
                    self.seq_hit_tokens += own
        if hit:
            self.hits += 1
            self.hit_tokens += hit
        return hit

    def release(self, key, prefix_len: int, seq=None, context: int = 0) -> None:
        """A running sequence left the batch (finished, aborted, preempted) with `context`
        tokens of KV: its group (if `key`) loses a holder, its own context (if `seq`) is cached."""
        if key is not None:
            n = self.held[key] - 1
            if n:
                self.held[key] = n
            else:
                del self.held[key]
                self.free[key] = prefix_len
                self.free_tokens += prefix_len
        if seq is not None and context > 0:
            old = self.free.pop(seq, None)
            if old is not None:
                self.free_tokens -= old
            self.free[seq] = context
            self.free_tokens += context

    def evict(self, context: int) -> None:
        """Drop free entries, oldest first, while they and the running context overflow KV."""
        free = self.free
        while free and self.free_tokens + context > self.capacity:
            _, n = free.popitem(last=False)
            self.free_tokens -= n
            self.evictions += 1

    def drop_free(self) -> None:
        """reset_prefix_cache: the free pool goes; what running sequences hold stays (as in vLLM)."""
        self.free.clear()
        self.free_tokens = 0
