"""PullLoop: a replica's long-poll to the router. Each step drains the engine's deltas, sends
them with its stats in a Report, applies the Orders that answer it, and paces the next pull.

Invariants:
- No delta is lost: what a pull did not deliver is kept (`unsent`) and sent again; the router
  drops what it already has (SeqProgress.offset).
- A final report goes whole where another router may take it: after a failed pull (the router
  may have restarted) or when a router other than the one answering started its segment
  (router_adoption.py). The engine keeps a final's whole output until its answer is applied.
- Work never starts beside a weights load or a sleep move (EngineMoves.ready_for_work).
- An engine that died says goodbye at once (Report.engine_dead) and the loop ends; so does one
  whose weights or memory a failed move left unknown (EngineMoves.broken), after giving up what it
  ran: its work continues elsewhere at once, none of it on a mix of weights.
- A replica the router declared stalled (Orders.stop: its sequences made no progress for
  router.stall_timeout_s) ends its loop at once and reports nothing more: the router continues
  its work elsewhere, so nothing it holds may be sent or handed back (`stalled`).

The router call is injected (`pull(report) -> awaitable Orders`) and so is the clock: the loop
runs against a fake router without Ray, and on any event loop.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Optional

from ..config import URGENT_REPORT_GAP_FRAC, RouterConfig
from ..protocol import Listing, ModelInfo, Orders, Report, SeqProgress, WeightsState
from .engine_moves import EngineMoves
from .timeline import Timeline

log = logging.getLogger("ray.serve")
HELD_EVERY_S = 2.0  # how often a report lists every attempt the engine holds (lost-reply recovery)
HAND_BACK_S = 10.0  # the most time a goodbye (and, at shutdown, the whole hand-back) may take
PACE_TICK_S = 0.01  # how often a paced replica looks for a segment that ended
RETRY_S = 0.5  # the pause after a failed pull


class PullLoop:
    def __init__(self, engine, moves: EngineMoves, pull: Callable[[Report], Awaitable[Orders]], *,
                 replica_id: str, incarnation: str, model: Optional[ModelInfo], router_cfg: RouterConfig,
                 clock: Callable[[], float] = time.monotonic, timeline: Optional[Timeline] = None):
        self.engine, self.moves, self._pull = engine, moves, pull
        self.replica_id, self.incarnation, self.model = replica_id, incarnation, model
        self.router_cfg, self.clock = router_cfg, clock
        self.timeline = timeline  # where each step's times go (timeline.py), when recording
        self.unsent: list[SeqProgress] = []  # drained and not yet delivered: sent again after a failed pull
        self.dispatched: dict = {}  # (seq_id, attempt) -> the router that started it (Orders.router_id)
        self.report_number = 0  # counts the reports built (Report.number)
        self.router_id = ""  # the router that answered the last pull (Orders.router_id)
        self.pull_failed = False  # the last pull failed: the router may have restarted since
        # The model goes with the first report, the first after a failed pull, and every listing: a
        # router that restarted while this replica's pulls went through learns it within HELD_EVERY_S.
        self.send_model = True
        self.held_t = -float("inf")  # when the last listing was taken
        self.stopping = False
        self.error: Optional[BaseException] = None  # why the loop ended early
        self.stalled = False  # the router declared this replica stalled: its work runs elsewhere now

    async def run(self) -> None:
        """Step until stopped, or until the engine died (after its goodbye)."""
        while not self.stopping:
            if not await self.step():
                return

    def stop(self) -> None:
        """End the loop after the pull in flight (and its orders)."""
        self.stopping = True

    async def step(self) -> bool:
        """One pull: report, pull, apply the orders, pace. False: the engine died, the loop is over."""
        started = time.monotonic()  # (the timeline's clock)
        marks = [time.perf_counter()] if self.timeline is not None else None
        ended = self.engine.ended  # before the drain: a segment ending after it shows as a change
        self.unsent += self.engine.drain()
        if self.engine.dead is not None:  # (an engine that died idle shows in the drain)
            await self.leave_dead_engine()
            return False
        if self.moves.broken is not None and not self.moves.in_progress():
            await self.leave_broken_engine()
            return False
        now = self.clock()
        report = self.build_report(now)
        if marks is not None:
            marks.append(time.perf_counter())
        orders = await self.pull(report)
        if orders is None:
            if marks is not None:
                marks.append(time.perf_counter())
            await asyncio.sleep(RETRY_S)
            if marks is not None:  # (no orders: nothing applied, the pause is the retry's)
                self._record(started, report, Orders(), marks[:2] + [marks[2]] * 2 + [time.perf_counter()], failed=True)
            return True
        if orders.stop:
            self.declared_stalled(orders.stop)
            return False
        if marks is not None:
            marks.append(time.perf_counter())
        if not await self.apply(orders, report.progress):
            return False
        if marks is not None:
            marks.append(time.perf_counter())
        await self.pace(now, ended, self._urgent(orders), orders.report_interval_s)
        if marks is not None:
            self._record(started, report, orders, marks + [time.perf_counter()])
        return True

    def _record(self, started: float, report: Report, orders: Orders, marks: list, failed: bool = False) -> None:
        """One line of the timeline (timeline.py): when the step began, what its pull carried and
        where its time went (a failed pull's line says so; its pace is the pause before the retry)."""
        ms = [round(1e3 * (b - a), 3) for a, b in zip(marks, marks[1:])]
        fields = dict(failed=True) if failed else {}
        self.timeline.record("pull", at=started, held=len(self.engine.held()), progress=len(report.progress),
                             tokens=sum(p.num_tokens for p in report.progress), start=len(orders.start),
                             report_ms=ms[0], pull_ms=ms[1], apply_ms=ms[2], pace_ms=ms[3], **fields)

    def build_report(self, now: float) -> Report:
        """Every undelivered delta (finals whole where another router may take them), the engine's
        stats and moves, and every HELD_EVERY_S the listing of what it holds."""
        self.unsent = [self._as_sent(p) for p in self.unsent]
        held, aborting = None, []
        if now - self.held_t >= HELD_EVERY_S:  # drained and listed together: consistent
            held, aborting, self.held_t = self.engine.held(), self.engine.aborting(), now
        self.report_number += 1
        weights, sleep = self.moves.states()
        return Report(self.replica_id, self.incarnation, progress=self.unsent, stats=self.engine.stats(),
                      model=self.model if self.send_model or held is not None else None,
                      capacity=self.engine.capacity, weights=weights, sleep=sleep,
                      listing=None if held is None else Listing(held, aborting), number=self.report_number,
                      digest=self.moves.digest)

    async def pull(self, report: Report) -> Optional[Orders]:
        """The router's answer, or None when the pull failed (its deltas stay unsent)."""
        try:
            # Bounded: a call to a router killed under it can stay unanswered for good (Serve's
            # handle does not always fail it), and past replica_timeout_s the router has taken this
            # replica for dead anyway. A late answer's orders are lost replies: the held listing
            # recovers their work.
            orders = await asyncio.wait_for(self._pull(report), self.router_cfg.replica_timeout_s)
        except Exception as e:  # router restarting or overloaded: keep the deltas, retry
            log.warning("pull failed (%r); retrying", e)
            self.pull_failed = self.send_model = True
            return None
        self.unsent = []
        self.moves.digest_delivered(report.digest)
        self.pull_failed = self.send_model = False
        self.router_id = orders.router_id
        return orders

    async def apply(self, orders: Orders, delivered: list) -> bool:
        """Control orders, then (after the moves) new work, whole finals, give-ups; `delivered` is
        the progress the answered report carried. False: the orders met a dead engine, which said
        goodbye. Any other failure ends the loop (check_health)."""
        try:
            for order in orders.control:
                self.moves.apply(order)
            start = orders.start
            if start and not await self.moves.ready_for_work():
                start = []
            for work in start:
                self.engine.submit(work)
                self.dispatched[(work.seq_id, work.attempt)] = orders.router_id
            if orders.report_whole:  # before the abort's final report; an ended one's again, whole
                self.engine.report_whole(orders.report_whole)
            self._delivered(delivered)
            if orders.give_up:
                await self.engine.give_up(orders.give_up)
        except Exception as e:
            if self.engine.dead is not None:
                await self.leave_dead_engine()
                return False
            self.error = e
            log.exception("replica %s failed applying orders", self.replica_id)
            raise
        return True

    async def pace(self, reported_t: float, ended: int, urgent: bool, interval_s: float = 0.0) -> None:
        """A replica that runs sequences reports every router.report_interval_s; and at once when a
        segment ends if that matters now (`urgent`): work is queued for the freed slot, or a
        give-up's partials go back. Every pull costs the router's process milliseconds of Ray Serve
        request handling, whatever it carries (scripts/router_pull_cost.py), so a fleet of busy
        replicas must not pull back to back; the router lengthens the interval (`interval_s`) once
        the fleet passes max_pulls_per_s x report_interval_s replicas (32 by default). A replica
        that holds nothing pulls again at once: the router holds that pull until work comes or
        router.idle_pull_wait_s passes (longer in a large fleet: RouterConfig.idle_pull_wait_for).
        An urgent end waits until URGENT_REPORT_GAP_FRAC of the interval has passed: while work is
        queued, segments end often enough (hundreds a second in a fleet of hundreds) to multiply
        the router's pulls otherwise; the freed slot idles at most that long (experiments/pull-budget)."""
        engine = self.engine
        if not engine.held():  # (when the last one ends, `ended` changes: the pace ends too)
            return
        interval = interval_s or self.router_cfg.report_interval_s
        deadline, urgent_from = reported_t + interval, reported_t + URGENT_REPORT_GAP_FRAC * interval
        while not self.stopping and (now := self.clock()) < deadline:
            if engine.dead is not None:
                return  # its sequences continue elsewhere: say goodbye now
            if engine.ended != ended:
                if not engine.held():
                    return  # an idle replica pulls at once: the router holds that pull
                if urgent and now >= urgent_from:
                    return
            await asyncio.sleep(PACE_TICK_S)

    def _urgent(self, orders: Orders) -> bool:
        """A segment that ends before the next report is worth reporting early: work waits for
        its slot, or partials of a give-up (or whole finals) go back."""
        return (orders.work_waiting or bool(orders.give_up) or bool(orders.report_whole)
                or bool(self.engine.aborting()))

    # ---- leaving --------------------------------------------------------------------------------
    def declared_stalled(self, why: str) -> None:
        """The router took this replica's work away (Orders.stop): end the loop, keep nothing to
        send. check_health fails from now on, and the shutdown hands nothing back."""
        self.stalled, self.stopping, self.unsent = True, True, []
        self.error = RuntimeError(f"the router declared this replica stalled ({why})")
        log.error("replica %s: %s", self.replica_id, self.error)

    def goodbye(self, partials: list = (), engine_dead: bool = False) -> Report:
        """The last report: everything not yet sent and `partials` (drained since), marked leaving
        (the router requeues the rest)."""
        self.unsent = [self._as_sent(p) for p in self.unsent + list(partials)]
        return Report(self.replica_id, self.incarnation, progress=self.unsent, stats=self.engine.stats(),
                      model=None, capacity=self.engine.capacity,
                      weights=WeightsState(version=self.moves.weights_version), leaving=True, engine_dead=engine_dead)

    def pull_abandoned(self) -> None:
        """The pull in flight was cancelled: whether it reached a router (which one) is unknown."""
        self.pull_failed = True

    async def leave_dead_engine(self) -> None:
        """The engine died under its sequences: say goodbye with what they made since the last
        report, so that the router continues them elsewhere at once, from their last tokens (not
        after router.replica_timeout_s); check_health then has Serve replace the replica."""
        self.error = RuntimeError(f"the engine died: {type(self.engine.dead).__name__}: {self.engine.dead}")
        report = self.goodbye(self.engine.drain(), engine_dead=True)
        try:
            await asyncio.wait_for(self._pull(report), HAND_BACK_S)
            self.unsent = []
        except Exception as e:  # the router requeues them after router.replica_timeout_s instead
            log.warning("replica %s: engine died and its goodbye failed (%r)", self.replica_id, e)

    async def leave_broken_engine(self) -> None:
        """A move left the engine's weights or memory unknown (EngineMoves.broken): give up what it
        runs (a keep swap's sequences end at their fence, weight_keep.py), say goodbye with their
        partials as a dead engine's replica does, and end the loop; check_health has Serve replace
        the replica. (Before, the router gave it work on seeing the version it held.)"""
        self.error = RuntimeError(f"restart needed: {self.moves.broken}")
        log.error("replica %s: %s", self.replica_id, self.error)
        partials = await self.give_up_all(HAND_BACK_S / 2)
        try:
            await asyncio.wait_for(self._pull(self.goodbye(partials, engine_dead=True)), HAND_BACK_S / 2)
            self.unsent = []
        except Exception as e:  # the router requeues them after router.replica_timeout_s instead
            log.warning("replica %s: broken engine's goodbye failed (%r)", self.replica_id, e)

    async def give_up_all(self, wait_s: float) -> list:
        """Give up every sequence the engine holds and collect their partials (waiting up to
        `wait_s` for the engine to end them)."""
        held = self.engine.held()
        if held:
            try:
                await self.engine.give_up(held)
            except Exception as e:  # (what it reported is still handed back: the rest continues from there)
                log.warning("giving up %d sequences failed (%r): handing back what they reported", len(held), e)
        partials, deadline = [], time.monotonic() + wait_s
        while self.engine.held() and time.monotonic() < deadline:
            partials += self.engine.drain()
            await asyncio.sleep(0.01)
        return partials + self.engine.drain()

    # ---- finals ---------------------------------------------------------------------------------
    def _delivered(self, progress: list) -> None:
        """These reports reached the router (and its answer was applied: it may ask for an ended
        segment's final again, whole): the engine may drop what it kept for their finals."""
        self.engine.forget_finals(progress)
        for p in progress:
            if p.finish_reason:
                self.dispatched.pop((p.seq_id, p.attempt), None)

    def _as_sent(self, p: SeqProgress) -> SeqProgress:
        """A final report as it goes to the router: whole after a failed pull, or when another
        router than the one answering now started the segment; the new router never got the
        earlier deltas, and continues the sequence from the whole output (router_adoption.py); an
        old router that was only slow drops the part it already has."""
        if not p.finish_reason:
            return p
        by = self.dispatched.get((p.seq_id, p.attempt))
        if self.pull_failed or (by is not None and by != self.router_id):
            return self.engine.whole_final(p)
        return p
