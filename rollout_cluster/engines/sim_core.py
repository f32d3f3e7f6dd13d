"""SimEngineCore: a vLLM-like engine in virtual time, driven by the cost model.

Each step admits waiting sequences while the batch has room (max_num_seqs) and KV fits
(prefill charged at the prefill rate, less the tokens found in the prefix cache: the group's
prompt or the sequence's own earlier context, prefix_cache.py), decodes one token for every
running sequence, and finishes those that reached their stop. Past KV capacity it preempts the newest running
sequence and recomputes it later, as vLLM does. `advance(limit)` jumps over many steps at once
while the batch is unchanged (closed form), which makes 32 replicas x 8192 sequences cheap.
Pure: no clock, no asyncio.
"""
from __future__ import annotations

import math
import zlib
from collections import deque
from dataclasses import dataclass

from ..protocol import SeqProgress, Work
from .cost_model import CostModel
from .prefix_cache import PrefixCache, seq_key


@dataclass(eq=False)
class _Seq:
    work: Work
    context: int  # tokens in KV: prompt (incl. earlier segments) + this segment's output
    stop: int  # tokens this segment produces before it ends
    produced: int = 0
    reported: int = 0
    admitted: bool = False
    admitted_once: bool = False  # a dispatched continuation's first admission counts as re-prefill


class SimEngineCore:
    def __init__(self, cost: CostModel, vocab_size: int = 32000, emit_tokens: bool = True):
        self.cost = cost
        self.vocab_size = vocab_size
        self.emit_tokens = emit_tokens
        self.waiting: deque = deque()
        self.running: list = []
        self.finals: list = []
        self.ended = 0  # final reports produced so far
        self.preemptions = 0
        self.reprefilled_tokens = 0  # continuations' prompt tokens actually prefilled (not cached)
        self.context = 0  # KV tokens of running sequences
        self.last_step_s = 0.0
        self.steps = 0
        self.prefix_cache = PrefixCache(cost.kv_tokens)

    def _leave(self, s: _Seq) -> None:
        """`s` leaves the running batch: its group's prompt is no longer held by it, and its own
        context (prompt + output so far) stays cached until evicted."""
        w = s.work
        self.prefix_cache.release(w.prefix_key, w.prefix_len, seq_key(w.seq_id), s.context)

    def submit(self, work: Work) -> None:
        stop = work.sampling.max_tokens if work.stop_after is None else min(work.sampling.max_tokens, work.stop_after)
        self.waiting.append(_Seq(work, work.prompt_len, max(1, stop)))

    def abort(self, keys) -> None:
        keys = set(keys)
        for group in (self.running, self.waiting):
            for s in list(group):
                if (s.work.seq_id, s.work.attempt) in keys:
                    group.remove(s)
                    if group is self.running:
                        self._leave(s)
                    self._final(s, "abort")
        self.context = sum(s.context for s in self.running)

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def _admit(self) -> float:
        """Admit waiting work; returns the prefill time charged to this step."""
        t = 0.0
        while self.waiting and len(self.running) < self.cost.max_num_seqs:
            s = self.waiting[0]
            # (the running sequences' next tokens come first, as vLLM schedules them)
            if self.context + len(self.running) + s.context + 1 > self.cost.kv_tokens and self.running:
                break
            self.waiting.popleft()
            s.admitted = True
            self.running.append(s)
            self.context += s.context
            w = s.work
            hit = self.prefix_cache.admit(w.prefix_key, w.prefix_len, seq_key(w.seq_id), s.context)
            prefilled = s.context - hit if hit < s.context else 0
            t += self.cost.prefill_s(prefilled)
            if not s.admitted_once and 0 < w.prefix_len < w.prompt_len:
                self.reprefilled_tokens += prefilled
            s.admitted_once = True
            self.prefix_cache.evict(self.context)  # (before the next admission looks the cache up)
        self.prefix_cache.evict(self.context)
        return t

    def _preempt_if_needed(self) -> None:
        while self.running and self.context + len(self.running) > self.cost.kv_tokens and len(self.running) > 1:
            s = self.running.pop()  # newest
            self.context -= s.context
            self._leave(s)
            s.admitted = False
            self.waiting.appendleft(s)  # recompute: re-prefilled with its output so far
            self.preemptions += 1

    def advance(self, limit_s: float = math.inf, max_steps: int = 1 << 30) -> float:
        """Run steps while the batch is unchanged, up to `limit_s` of virtual time (at least
        one step). Returns the virtual seconds spent."""
        prefill = self._admit()
        self._preempt_if_needed()
        if not self.running:
            return prefill
        b = len(self.running)
        k = min(min(s.stop - s.produced for s in self.running), max_steps)
        if self.cost.kv_tokens < math.inf:
            k = max(1, min(k, (self.cost.kv_tokens - self.context) // b))
        k, run_s = self.cost.decode_run(b, self.context, k, limit_s - prefill)
        dt = prefill + run_s
        self.last_step_s = (dt - prefill) / k
        self.steps += k
        for s in self.running:
            s.produced += k
            s.context += k
        self.context += b * k
        self.prefix_cache.evict(self.context)  # the context's peak since the last admission
        done = [s for s in self.running if s.produced >= s.stop]
        if done:
            self.running = [s for s in self.running if s.produced < s.stop]
            for s in done:
                self.context -= s.context
                self._leave(s)
                reason = "length" if s.produced >= s.work.sampling.max_tokens or s.work.stop_after is not None else "stop"
                self._final(s, reason)
        return dt

    def _tokens(self, s: _Seq, start: int, end: int) -> list:
        base = zlib.crc32(s.work.seq_id.encode()) % self.vocab_size  # (stable across processes, as hash() is not)
        return [(base + s.work.prompt_len + i) % self.vocab_size for i in range(start, end)]

    def _final(self, s: _Seq, reason: str) -> None:
        n = s.produced - s.reported
        toks = self._tokens(s, s.reported, s.produced) if self.emit_tokens else []
        lps = [-1.0] * n if self.emit_tokens and s.work.sampling.logprobs is not None else None
        self.finals.append(SeqProgress(s.work.seq_id, s.work.attempt, toks, lps, reason, num_tokens=n,
                                       offset=s.reported))
        self.ended += 1
        s.reported = s.produced

    def drain(self) -> list:
        out = []
        for s in self.running:
            n = s.produced - s.reported
            if n:
                toks = self._tokens(s, s.reported, s.produced) if self.emit_tokens else []
                lps = [-1.0] * n if self.emit_tokens and s.work.sampling.logprobs is not None else None
                out.append(SeqProgress(s.work.seq_id, s.work.attempt, toks, lps, None, num_tokens=n,
                                       offset=s.reported))
                s.reported = s.produced
        out += self.finals
        self.finals = []
        return out
