"""Discrete-event simulation in virtual time: RouterCore + a policy + SimEngineCores.

The router and the policy are the very objects the Ray Serve deployment runs; only transport
and the clock differ. Each replica pulls every `pull_interval_s` of virtual time (and at once
when a sequence finishes); between pulls its engine advances by the cost model.

Engines are FastEngineCore (sim/engine.py) by default: SimEngineCore's behaviour at a fraction
of the cost. `engine=SimEngineCore` (engines/sim_core.py) runs the reference engine, as the
equivalence test does.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import asdict, dataclass, field

from ..engines.cost_model import CostModel
from ..policy.base import Policy
from ..router.core import RouterCore
from ..protocol import EngineStats, ModelInfo, Report
from .engine import FastEngineCore


@dataclass
class SimResult:
    makespan_s: float
    completions: list
    counters: dict
    decision_times_s: list
    trace: dict = field(default_factory=dict)  # replica_id -> [(t, running sequences)]
    finish_times: list = field(default_factory=list)  # finish time of each sequence, in order
    busy_s: dict = field(default_factory=dict)  # replica_id -> seconds with work
    preemptions: int = 0
    # prompt + partial tokens of every continuation dispatched: migrations, but also chunked
    # rounds and requeues, which the router's `reprefill_tokens` counter does not see. What the
    # engines actually prefill may be less: a destination with the group's prompt in its prefix
    # cache prefills only the partial output (engines/prefix_cache.py); this counts tokens sent.
    reprefill_tokens: int = 0
    # Of those, the tokens the engines actually prefilled on the continuations' first admission
    # (prefix-cache hits subtracted): the re-prefill's real cost.
    reprefilled_tokens: int = 0
    # Tokens each sequence ended with, by batch index (the simulator keeps counts, not token ids):
    # what a cut batch's partial rollouts carry into the next one (run's cut_after).
    generated: list = field(default_factory=list)
    cut_s: float = -1.0  # when run's cut_after cancelled the batch (-1: it was not cut)


class Simulation:
    def __init__(self, policy: Policy, cost: CostModel, replicas: int, pull_interval_s: float = 0.5,
                 record_tokens: bool = False, max_model_len: int = 1 << 22, trace: bool = True,
                 engine=FastEngineCore, max_virtual_s: float = 1e7, host_slowdown: float = 0.0):
        self.cost = cost
        self.n = replicas
        self.pull_interval_s = pull_interval_s
        self.core = RouterCore(policy, expected_replicas=replicas, replica_timeout_s=float("inf"),
                               record_tokens=record_tokens)
        self.engines = {f"r{i:02d}": engine(cost, emit_tokens=record_tokens) for i in range(replicas)}
        self.clock = {rid: 0.0 for rid in self.engines}
        self.busy = {rid: 0.0 for rid in self.engines}
        self.model = ModelInfo(vocab_size=32000, max_model_len=max_model_len, model=f"sim:{cost.name}")
        self.want_trace = trace
        self.max_virtual_s = max_virtual_s  # a policy that never finishes the batch fails here
        self.reprefill_tokens = 0
        # Replicas that share one host (the 2-core CPU benchmark: memory bandwidth, caches) slow
        # each other: a replica's steps take (1 + host_slowdown * share of the others busy) as long.
        # 0 for replicas on separate GPUs. Replicas advance a pull interval at a time, so a change
        # of the others' state takes effect within one interval.
        if not host_slowdown >= 0:
            raise ValueError(f"host_slowdown={host_slowdown!r}: must be >= 0")
        # (an idle replica pulls again a pull interval later: 0 would never advance virtual time)
        if not 0 < pull_interval_s < float("inf"):
            raise ValueError(f"pull_interval_s={pull_interval_s!r}: must be > 0 and finite")
        self.host_slowdown = host_slowdown
        self.slowdown = {rid: 1.0 for rid in self.engines}
        self.last_pull = {rid: 0.0 for rid in self.engines}
        self.pull_times: list = []  # virtual time of every pull, registration pulls excluded

    def _slowdown(self, rid: str) -> float:
        if not self.host_slowdown or self.n < 2:
            return 1.0
        others = sum(1 for r, e in self.engines.items() if r != rid and e.busy)
        return 1.0 + self.host_slowdown * others / (self.n - 1)

    def _report(self, rid: str, first: bool) -> Report:
        e = self.engines[rid]
        stats = EngineStats(running=len(e.running), context_tokens=e.context,
                            step_time_s=e.last_step_s * self.slowdown[rid])
        return Report(rid, "sim", progress=e.drain(), stats=stats, model=self.model if first else None,
                      capacity=self.cost.max_num_seqs)

    def _advance(self, rid: str, until: float) -> None:
        e = self.engines[rid]
        t = self.clock[rid]
        while t < until and e.busy:
            f = self.slowdown[rid] = self._slowdown(rid)
            dt = e.advance(limit_s=(until - t) / f) * f
            self.busy[rid] += dt
            t += dt
            if e.finals:
                break  # report finished work at once: the real replica would at its next pull
        self.clock[rid] = max(t, until) if not e.finals else t

    def run(self, requests: list, cut_after: int = 0) -> SimResult:
        """Run one batch to its end. `cut_after` > 0: cancel the batch once that many sequences are
        done, as generate's finish_fraction does; the rest end as "abort" with what they made."""
        core = self.core
        generated = [0] * len(requests)
        cut_s = -1.0
        for rid in self.engines:  # registration pulls, as replicas start
            core.on_report(self._report(rid, True), 0.0)
        core.submit(requests, 0.0, batch_id="sim")
        batch = core.batches["sim"]
        trace = {rid: [] for rid in self.engines}
        heap = [(0.0, rid) for rid in sorted(self.engines)]
        heapq.heapify(heap)
        timer = time.perf_counter
        finish_times = []
        now = 0.0
        while len(batch.order) < batch.size:
            now, rid = heapq.heappop(heap)
            if now > self.max_virtual_s:
                raise RuntimeError(f"simulation passed {self.max_virtual_s:.0f} s of virtual time with "
                                   f"{batch.size - len(batch.order)} of {batch.size} sequences unfinished")
            if now > self.clock[rid]:
                self._advance(rid, now)
                now = self.clock[rid]
            done_before = len(batch.order)
            self.last_pull[rid] = now
            self.pull_times.append(now)
            finals = len(self.engines[rid].finals)  # drain() puts them last; a final has no delta beside it
            report = self._report(rid, False)
            for p in report.progress[len(report.progress) - finals:]:
                seq = core.seqs.get(p.seq_id)
                if seq is not None and seq.attempt == p.attempt:
                    generated[seq.index] = seq.generated + p.num_tokens
            orders = core.on_report(report, now, timer)
            if 0 < cut_after <= len(batch.order) and cut_s < 0 and len(batch.order) < batch.size:
                cut_s = now
                for seq in core.seqs.values():
                    if seq.batch_id == "sim":
                        generated[seq.index] = seq.generated  # the queued ones end here, at once
                core.cancel("sim", now)
            finish_times += [now] * (len(batch.order) - done_before)
            e = self.engines[rid]
            for w in orders.start:
                self._count_reprefill(w)
                e.submit(w)
            if orders.give_up:
                e.abort(orders.give_up)
            if self.want_trace:
                trace[rid].append((now, len(e.running) + len(e.waiting)))
            # Give-ups ordered for other replicas wait for their next pull, like the real system.
            # (an idle replica with a final to report, a give-up's abort, pulls again at once, as PullLoop.pace)
            nxt = now if (e.finals and not e.busy) else now + self.pull_interval_s
            if e.busy:
                self._advance(rid, nxt)
                nxt = max(self.clock[rid], now + 1e-6)
            heapq.heappush(heap, (nxt, rid))
        completions = [None if c is None else c.with_lists() for c in batch.results]
        return SimResult(makespan_s=max(finish_times, default=0.0), completions=completions,
                         counters=asdict(core.counters), decision_times_s=core.decision_times,
                         trace=trace, finish_times=finish_times, busy_s=dict(self.busy),
                         preemptions=sum(e.preemptions for e in self.engines.values()),
                         reprefill_tokens=self.reprefill_tokens,
                         reprefilled_tokens=sum(e.reprefilled_tokens for e in self.engines.values()),
                         generated=generated, cut_s=cut_s)

    def _count_reprefill(self, work) -> None:
        seq = self.core.seqs.get(work.seq_id)
        if seq is not None and work.prompt_len > seq.request.prompt_len:
            self.reprefill_tokens += work.prompt_len
