"""A scripted replica for the race drill (test_race_drill.py): an engine whose every token is known
in advance, and serve/pull_loop.py's PullLoop taken apart, so that the drill decides when each
step happens and which pull fails.

The engine generates, for a prompt, the run `Truth.tokens`: token i is (key + i) % VOCAB, and the
run stops ("stop") after `stop_at` tokens, whichever segment generates it. A continuation must
therefore carry the router's tokens so far as its prompt's tail (checked: `violations`), and a
final's tokens are exactly the run's first ones. As vllm_engine.py's VllmEngine does, it drains
deltas numbered by offset, keeps an ended segment's output until its final is delivered (sent whole
after a failed pull, or when asked: Orders.report_whole), lists what it holds and what it is
aborting, and its abort lands at once, at its next report or after it (vLLM's abort is asynchronous): a
natural end before it lands wins, and an attempt that ended is not aborted. A pull is three steps the drill places apart:
`send` (build the report; the router applies it now, or never, or twice, or late), then `receive`
(the answer arrives, or the call failed). `goodbye` is replica.py's hand-back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rollout_cluster.protocol import EngineStats, Listing, ModelInfo, Report, SeqProgress, Work

VOCAB = 1009
MODEL = ModelInfo(VOCAB, 4096, "drill")
CAPACITY = 8
PULL_FAULTS = ("none", "lost_reply", "lost_report", "dup_first", "dup_second", "late")


@dataclass(frozen=True)
class Truth:
    """What the engine generates for one prompt."""

    key: int  # token i of the run is (key + i) % VOCAB
    stop_at: int  # the run's natural end (a stop token) after this many tokens

    def tokens(self, start: int, end: int) -> list:
        return [(self.key + i) % VOCAB for i in range(start, end)]


@dataclass
class Run:
    """One attempt the engine holds."""

    work: Work
    out: list  # every token this segment will produce, to its end
    reason: str  # "stop" or "length": why it ends after `out`
    produced: int = 0  # tokens made so far
    drained: int = 0  # tokens put in deltas so far
    aborting: bool = False  # a give-up arrived; the abort has not landed
    slow: bool = False  # ... and lands only after the next report (listed as aborting there)


class Engine:
    def __init__(self, truths: dict, violations: list):
        self.truths, self.violations = truths, violations  # tuple(prompt) -> Truth; what went wrong
        self.runs: dict = {}  # (seq_id, attempt) -> Run, until its final is drained
        self.pending: list = []  # finals made outside a drain (aborts that landed, whole finals asked for)
        self.whole: set = set()  # running attempts whose final goes whole (report_whole)
        self.ended_whole: dict = {}  # ended attempts -> (Run, reason), until their final is delivered

    def submit(self, work: Work) -> None:
        prompt = work.prompt_token_ids
        truth = self.truths[tuple(prompt[:work.prefix_len])]
        start = work.prompt_len - work.prefix_len
        if list(prompt[work.prefix_len:]) != truth.tokens(0, start):
            self.violations.append(f"{work.seq_id}#{work.attempt}: its prompt's tail is not the run's first {start}")
        end = min(truth.stop_at, start + work.sampling.max_tokens,
                  start + work.stop_after if work.stop_after is not None else truth.stop_at)
        self.runs[(work.seq_id, work.attempt)] = Run(work, truth.tokens(start, end),
                                                     "stop" if end == truth.stop_at else "length")

    def advance(self, key, n: int, to_end: bool = False) -> None:
        """`n` more tokens of `key` (not its last one unless `to_end`)."""
        run = self.runs.get(key)
        if run is not None and not run.aborting:
            run.produced = len(run.out) if to_end else max(run.produced, min(run.produced + n, len(run.out) - 1))

    def finish(self, key) -> bool:
        """`key` ends naturally now (before an abort on its way lands); False: it was not running."""
        run = self.runs.get(key)
        if run is not None:
            run.aborting, run.produced = False, len(run.out)
        return run is not None

    def finish_all(self) -> None:
        for key, run in self.runs.items():
            if not run.aborting:
                run.produced = len(run.out)

    def give_up(self, keys, when: str) -> None:
        """Abort these attempts: the abort lands `when` ("now", at the "next" report, or "slow":
        after it); one that ended (its final not drained yet) ends as it did."""
        for key in map(tuple, keys):
            run = self.runs.get(key)
            if run is not None and not run.aborting and run.produced < len(run.out):
                run.aborting, run.slow = True, when == "slow"
                if when == "now":
                    self.pending.append(self._final(key, run, "abort"))

    def land_aborts(self, slow: Optional[bool] = None) -> None:
        """The aborts on their way land (only the slow ones, or only the others; None: all)."""
        for key, run in list(self.runs.items()):
            if run.aborting and (slow is None or run.slow == slow):
                self.pending.append(self._final(key, run, "abort"))

    def drain(self) -> list:
        out, self.pending = self.pending, []
        for key, run in list(self.runs.items()):
            if run.produced == len(run.out) and not run.aborting:
                out.append(self._final(key, run, run.reason))
            elif run.produced > run.drained:
                out.append(SeqProgress(key[0], key[1], run.out[run.drained:run.produced], offset=run.drained))
                run.drained = run.produced
        return out

    def _final(self, key, run: Run, reason: str) -> SeqProgress:
        del self.runs[key]
        if key in self.whole:
            self.whole.discard(key)
            return self._whole(run, reason)
        self.ended_whole[key] = (run, reason)
        p = SeqProgress(key[0], key[1], run.out[run.drained:run.produced], None, reason, offset=run.drained)
        run.drained = run.produced
        return p

    @staticmethod
    def _whole(run: Run, reason: str) -> SeqProgress:
        w = run.work
        return SeqProgress(w.seq_id, w.attempt, run.out[:run.produced], None, reason, offset=0,
                           prompt_token_ids=list(w.prompt_token_ids), weight_versions=w.weight_versions)

    def whole_final(self, p: SeqProgress) -> SeqProgress:
        kept = self.ended_whole.get((p.seq_id, p.attempt)) if p.finish_reason else None
        return p if kept is None or p.prompt_token_ids is not None else self._whole(kept[0], p.finish_reason)

    def report_whole(self, keys) -> None:
        for key in map(tuple, keys):
            if key in self.runs:
                self.whole.add(key)
            elif key in self.ended_whole:
                self.pending.append(self._whole(*self.ended_whole.pop(key)))

    def forget_finals(self, delivered: list) -> None:
        for p in delivered:
            if p.finish_reason:
                self.ended_whole.pop((p.seq_id, p.attempt), None)

    def held(self) -> list:
        return list(self.runs)

    def aborting(self) -> list:
        return [k for k, r in self.runs.items() if r.aborting]


class Replica:
    """PullLoop's steps, each called by the drill."""

    def __init__(self, rid: str, truths: dict, violations: list):
        self.rid, self.truths, self.violations = rid, truths, violations
        self.restarts = 0
        self._fresh()

    def _fresh(self) -> None:
        """A new process: new incarnation, empty engine, nothing unsent."""
        self.incarnation = f"{self.rid}-{self.restarts}"
        self.engine = Engine(self.truths, self.violations)
        self.unsent: list = []  # drained, not yet delivered: sent again after a failed pull
        self.pull_failed = False  # the last pull failed: finals go whole
        self.number = 0  # reports built (Report.number)
        self.answer: Optional[tuple] = None  # (Orders, the progress they acknowledge) on their way
        self.late: list = []  # reports the router applies late: after this replica's next one
        self.up = True  # it pulls (False: it left, or its engine died)
        self.router_id = ""  # the router that answered last (Orders.router_id)
        self.dispatched: dict = {}  # (seq_id, attempt) -> the router that started it

    def restart(self) -> None:
        """Serve restarts the process: what it held and had not sent is gone (not its late pulls)."""
        late = self.late
        self.restarts += 1
        self._fresh()
        self.late = late

    def _as_sent(self, p: SeqProgress) -> SeqProgress:
        if not p.finish_reason:
            return p
        by = self.dispatched.get((p.seq_id, p.attempt))
        return self.engine.whole_final(p) if self.pull_failed or (by is not None and by != self.router_id) else p

    def build(self, listing: bool) -> Report:
        e = self.engine
        e.land_aborts(slow=False)
        self.unsent += e.drain()
        self.unsent = [self._as_sent(p) for p in self.unsent]
        held = Listing(e.held(), e.aborting()) if listing else None
        e.land_aborts(slow=True)  # a slow abort was listed as aborting: it lands now
        self.number += 1
        return Report(self.rid, self.incarnation, progress=list(self.unsent), stats=EngineStats(), model=MODEL,
                      capacity=CAPACITY, listing=held, number=self.number)

    def send(self, core, now: float, fault: str = "none", listing: bool = True, report: Optional[Report] = None):
        """A pull goes out; the router applies it as `fault` says. Reports it processes late are
        applied after the next one of this replica."""
        report = report or self.build(listing)
        earlier, self.late = self.late, []
        orders = None
        if fault == "late":
            self.late.append(report)
        elif fault != "lost_report":
            orders = core.on_report(report, now)
            if fault in ("dup_first", "dup_second"):
                again = core.on_report(report, now)
                orders = orders if fault == "dup_first" else again
            if fault == "lost_reply":
                orders = None
            if orders is not None:
                orders.router_id = core.id_prefix  # (the Serve router names itself)
        for old in earlier:
            core.on_report(old, now)  # its answer goes nowhere
        self.answer = None if orders is None else (orders, report.progress)
        return orders

    def flush_late(self, core, now: float) -> None:
        earlier, self.late = self.late, []
        for old in earlier:
            core.on_report(old, now)

    def receive(self, abort: str = "now") -> None:
        """The answer arrives and is applied, or the call failed (timed out): deltas kept."""
        if self.answer is None:
            self.pull_failed = True
            return
        (orders, delivered), self.answer = self.answer, None
        self.unsent, self.pull_failed, self.router_id = [], False, orders.router_id
        for work in orders.start:
            self.engine.submit(work)
            self.dispatched[(work.seq_id, work.attempt)] = orders.router_id
        if orders.report_whole:
            self.engine.report_whole(orders.report_whole)
        self.engine.forget_finals(delivered)
        for p in delivered:
            if p.finish_reason:
                self.dispatched.pop((p.seq_id, p.attempt), None)
        if orders.give_up:
            self.engine.give_up(orders.give_up, abort)

    def goodbye(self, engine_dead: bool = False) -> Report:
        """replica.py's hand-back (or PullLoop.leave_dead_engine): give up everything, send the
        partials and everything unsent in a last report marked leaving; the replica stops."""
        e = self.engine
        if engine_dead:
            for run in e.runs.values():  # what it streamed before dying; no final
                run.aborting = False
            for key, run in list(e.runs.items()):
                if run.produced > run.drained:
                    e.pending.append(SeqProgress(key[0], key[1], run.out[run.drained:run.produced], offset=run.drained))
            e.runs.clear()
        else:
            e.give_up(e.held(), "now")
            e.land_aborts()
        self.unsent = [self._as_sent(p) for p in self.unsent + e.drain()]
        self.up = False
        return Report(self.rid, self.incarnation, progress=list(self.unsent), stats=EngineStats(), model=None,
                      capacity=CAPACITY, leaving=True, engine_dead=engine_dead)
