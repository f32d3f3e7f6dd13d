"""FastEngineCore: SimEngineCore's exact behaviour at a lower cost per event.

The reference engine (engines/sim_core.py) touches every running sequence at every jump
(`min` over stops, `produced += k`, the `done` scan), which at 32 replicas x 256 running
sequences dominated the simulator's own time. Here a sequence's progress is implied by the
engine's step counter: a sequence admitted at step s0 with p0 tokens produced has produced
p0 + (steps - s0) now, and ends at step s0 + (stop - p0). A heap of end steps gives the next
finish in O(log n); only `drain` (one progress delta per running sequence, which the protocol
requires) still walks the batch.

Both share the prefix cache (engines/prefix_cache.py), called at the same points. Equivalence
with SimEngineCore (same admissions, preemptions, step times, cache hits and evictions, finish
order and reports) is a test (tests/test_sim.py). Pure: no clock, no asyncio.
"""
from __future__ import annotations

import heapq
import math
import zlib
from collections import deque
from itertools import count

from ..engines.cost_model import CostModel
from ..engines.prefix_cache import PrefixCache, seq_key
from ..protocol import SeqProgress, Work

_new = object.__new__


def progress(seq_id: str, attempt: int, tokens: list, logprobs, reason, n: int) -> SeqProgress:
    """A SeqProgress without the dataclass __init__ (a third of the cost; same fields)."""
    p = _new(SeqProgress)
    p.__dict__ = {"seq_id": seq_id, "attempt": attempt, "token_ids": tokens, "logprobs": logprobs,
                  "finish_reason": reason, "error": None, "num_tokens": n}
    return p


class _Seq:
    """One segment. While running: produced = p0 + (engine.steps - s0), context likewise."""

    __slots__ = ("work", "seq_id", "attempt", "ctx0", "stop", "p0", "s0", "reported", "order", "end", "key", "plen",
                 "skey", "continuation")

    def __init__(self, work: Work, stop: int):
        self.work, self.seq_id, self.attempt = work, work.seq_id, work.attempt
        self.ctx0 = work.prompt_len  # context when last admitted (or at submit)
        self.stop = stop
        self.p0 = 0  # tokens produced when last admitted
        self.s0 = 0  # engine step when last admitted
        self.reported = 0
        self.order = 0  # admission number: running order, newest is preempted first
        self.end = 0  # engine step at which it reaches `stop`
        self.key, self.plen = work.prefix_key, work.prefix_len  # prefix cache: group and prompt length
        self.skey = seq_key(work.seq_id)  # prefix cache: the sequence's own context
        self.continuation = 0 < work.prefix_len < work.prompt_len  # until first admitted: counts as re-prefill


class FastEngineCore:
    def __init__(self, cost: CostModel, vocab_size: int = 32000, emit_tokens: bool = True):
        self.cost = cost
        self.vocab_size = vocab_size
        self.emit_tokens = emit_tokens
        self.waiting: deque = deque()
        self.running: dict = {}  # order -> _Seq, in admission order
        self.ends: list = []  # heap of (end step, order) of running sequences (lazy deletion)
        self.finals: list = []
        self.preemptions = 0
        self.reprefilled_tokens = 0  # continuations' prompt tokens actually prefilled (not cached)
        self.context = 0  # KV tokens of running sequences
        self.last_step_s = 0.0
        self.steps = 0
        self._order = count()
        self.prefix_cache = PrefixCache(cost.kv_tokens)

    # ---- helpers ------------------------------------------------------------------------
    def _freeze(self, s: _Seq) -> None:
        """Leaving the running set: fold the implied progress into p0/ctx0."""
        done = self.steps - s.s0
        s.p0 += done
        s.ctx0 += done
        s.s0 = self.steps

    # ---- EngineAdapter-like face (as SimEngineCore) -------------------------------------
    def submit(self, work: Work) -> None:
        stop = work.sampling.max_tokens if work.stop_after is None else min(work.sampling.max_tokens, work.stop_after)
        self.waiting.append(_Seq(work, max(1, stop)))

    def abort(self, keys) -> None:
        keys = set(keys)
        hit = [s for s in self.running.values() if (s.seq_id, s.attempt) in keys]
        for s in hit:
            del self.running[s.order]
            self._freeze(s)
            self.prefix_cache.release(s.key, s.plen, s.skey, s.ctx0)
            self._final(s, "abort")
        if any((s.seq_id, s.attempt) in keys for s in self.waiting):
            for s in [s for s in self.waiting if (s.seq_id, s.attempt) in keys]:
                self.waiting.remove(s)
                self._final(s, "abort")
        if hit:
            self.context = sum(s.ctx0 + self.steps - s.s0 for s in self.running.values())

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting)

    def _admit(self) -> float:
        cost, t, cache = self.cost, 0.0, self.prefix_cache
        while self.waiting and len(self.running) < cost.max_num_seqs:
            s = self.waiting[0]
            # (the running sequences' next tokens come first, as vLLM schedules them)
            if self.context + len(self.running) + s.ctx0 + 1 > cost.kv_tokens and self.running:
                break
            self.waiting.popleft()
            s.s0, s.order = self.steps, next(self._order)
            s.end = self.steps + (s.stop - s.p0)
            self.running[s.order] = s
            heapq.heappush(self.ends, (s.end, s.order))
            self.context += s.ctx0
            hit = cache.admit(s.key, s.plen, s.skey, s.ctx0)
            prefilled = s.ctx0 - hit if hit < s.ctx0 else 0
            t += cost.prefill_s(prefilled)
            if s.continuation:
                self.reprefilled_tokens += prefilled
                s.continuation = False
            if cache.free and cache.free_tokens + self.context > cost.kv_tokens:
                cache.evict(self.context)  # (before the next admission looks the cache up)
        return t

    def _preempt_if_needed(self) -> None:
        kv = self.cost.kv_tokens
        while self.running and self.context + len(self.running) > kv and len(self.running) > 1:
            _, s = self.running.popitem()  # newest
            self._freeze(s)
            self.context -= s.ctx0
            self.prefix_cache.release(s.key, s.plen, s.skey, s.ctx0)
            self.waiting.appendleft(s)  # recompute: re-prefilled with its output so far
            self.preemptions += 1

    def _next_end(self) -> int:
        ends, running = self.ends, self.running
        while ends:
            end, order = ends[0]
            s = running.get(order)
            if s is not None and s.end == end:
                return end
            heapq.heappop(ends)  # stale: aborted or preempted since
        return self.steps

    def advance(self, limit_s: float = math.inf, max_steps: int = 1 << 30) -> float:
        """As SimEngineCore.advance: steps while the batch is unchanged, up to `limit_s`."""
        prefill = self._admit()
        self._preempt_if_needed()
        if not self.running:
            return prefill
        cost = self.cost
        b = len(self.running)
        k = min(self._next_end() - self.steps, max_steps)
        if cost.kv_tokens < math.inf:
            k = max(1, min(k, (cost.kv_tokens - self.context) // b))
        k, run_s = cost.decode_run(b, self.context, k, limit_s - prefill)
        dt = prefill + run_s
        self.last_step_s = (dt - prefill) / k
        self.steps += k
        self.context += b * k
        pc = self.prefix_cache
        if pc.free and pc.free_tokens + self.context > cost.kv_tokens:
            pc.evict(self.context)  # the context's peak since the last admission
        self._finish_due()
        return dt

    def _finish_due(self) -> None:
        ends, running, steps = self.ends, self.running, self.steps
        done = []
        while ends and ends[0][0] <= steps:
            end, order = heapq.heappop(ends)
            s = running.get(order)
            if s is not None and s.end == end:
                done.append(s)
        done.sort(key=lambda s: s.order)  # the reference reports in running order
        release = self.prefix_cache.release
        for s in done:
            del running[s.order]
            self._freeze(s)
            self.context -= s.ctx0
            release(s.key, s.plen, s.skey, s.ctx0)
            w = s.work
            reason = "length" if s.p0 >= w.sampling.max_tokens or w.stop_after is not None else "stop"
            self._final(s, reason)

    def _tokens(self, s: _Seq, start: int, end: int) -> list:
        base = zlib.crc32(s.seq_id.encode()) % self.vocab_size  # (stable across processes, as hash() is not)
        return [(base + s.work.prompt_len + i) % self.vocab_size for i in range(start, end)]

    def _final(self, s: _Seq, reason: str) -> None:
        n = s.p0 - s.reported
        emit = self.emit_tokens
        toks = self._tokens(s, s.reported, s.p0) if emit else []
        lps = [-1.0] * n if emit and s.work.sampling.logprobs is not None else None
        s.reported = s.p0
        self.finals.append(progress(s.seq_id, s.attempt, toks, lps, reason, n))

    def drain(self) -> list:
        """Every delta since the last drain: running sequences in order, then the finals."""
        out = []
        steps, emit = self.steps, self.emit_tokens
        for s in self.running.values():
            produced = s.p0 + steps - s.s0
            n = produced - s.reported
            if n:
                if emit:
                    lps = [-1.0] * n if s.work.sampling.logprobs is not None else None
                    out.append(progress(s.seq_id, s.attempt, self._tokens(s, s.reported, produced), lps, None, n))
                else:
                    out.append(progress(s.seq_id, s.attempt, [], None, None, n))
                s.reported = produced
        out += self.finals
        self.finals = []
        return out
