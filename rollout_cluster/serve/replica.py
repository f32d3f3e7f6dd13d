"""EngineReplica deployment: hosts one engine and pulls work from the Router.

The pull loop: drain the engine's deltas, send them with stats in a Report, apply the Orders.
A report that fails to reach the router is kept and sent again, so no delta is lost. Ray Serve
restarts a crashed replica; the new one has a new incarnation and the router requeues the old
one's sequences from their last reported tokens.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import Optional

from ray import serve

from ..config import URGENT_REPORT_GAP_FRAC, load_config
from ..engines.base import SleepRefused, WeightsLoadBroken
from ..engines.factory import make_engine
from ..protocol import (ControlOrder, Listing, LoadWeights, NoteWeights, Report, Sleep, SleepState, Wake,
                        WeightsState)

log = logging.getLogger("ray.serve")
HELD_EVERY_S = 2.0  # how often a report lists every attempt the engine holds (lost-reply recovery)
HAND_BACK_S = 10.0  # at shutdown, the most time spent giving the router back what this replica holds
PACE_TICK_S = 0.01  # how often a paced replica looks for a segment that ended


def replica_rank() -> int:
    ctx = serve.get_replica_context()
    rank = getattr(ctx, "rank", 0)
    return int(getattr(rank, "rank", rank) or 0)


@serve.deployment
class EngineReplica:
    # vLLM sleep mode: the level the engine is at, the one the router last ordered, why reaching
    # it failed, and the move under way (it runs after any load or move before it)
    sleep_level, sleep_goal, sleep_error, sleep_task = 0, 0, None, None
    noted = (0, "")  # (version, path) of an update ordered while asleep: loaded at wake
    report_number = 0  # counts the reports built (Report.number)
    router_id = ""  # the router that answered the last pull (Orders.router_id)
    pull_failed = False  # the last pull failed: the router may have restarted since

    async def __init__(self, router, config: dict):
        self.cfg = load_config(config)
        self.router = router
        ctx = serve.get_replica_context()
        self.replica_id = ctx.replica_id.unique_id
        self.incarnation = uuid.uuid4().hex[:8]
        self.engine = make_engine(self.cfg, replica_rank())
        self.model = await self.engine.start()
        self.unsent: list = []
        self.stopping = False
        self.loop_error = None
        self.weights_version = 0  # the config's model
        self.weights_error = None
        self.weights_error_version = 0
        self.weights_path = ""
        self.loading = None  # (version, asyncio.Task) of a load in progress
        self.broken = None  # set when a failed load left the engine's weights unknown
        self.task = asyncio.get_running_loop().create_task(self._pull_loop())

    async def _pull_loop(self) -> None:
        first = True
        self.dispatched = {}  # (seq_id, attempt) -> the router that started it (Orders.router_id)
        held_t = 0.0
        while not self.stopping:
            ended = self.engine.ended  # before the drain: a segment ending after it shows as a change
            self.unsent += self.engine.drain()
            if self.engine.dead is not None:  # (an engine that died idle shows in the drain)
                await self._leave_dead_engine()
                return
            if self.unsent:
                self.unsent = [self._as_sent(p) for p in self.unsent]
            now = time.monotonic()
            held, aborting = None, []
            if now - held_t >= HELD_EVERY_S:  # drained and listed together: consistent
                held, aborting, held_t = self.engine.held(), self.engine.aborting(), now
            # The model goes with the first report and every listing: a router that restarted
            # while this replica's pulls went through learns it within HELD_EVERY_S.
            self.report_number += 1
            report = Report(self.replica_id, self.incarnation, progress=self.unsent, stats=self.engine.stats(),
                            model=self.model if first or held is not None else None, capacity=self.engine.capacity,
                            weights=WeightsState(version=self.weights_version, error=self.weights_error,
                                                 error_version=self.weights_error_version,
                                                 loading=self.loading[0] if self.loading else 0,
                                                 path=self.weights_path, noted=self.noted[0],
                                                 noted_path=self.noted[1]),
                            sleep=SleepState(level=self.sleep_level, goal=self.sleep_goal, error=self.sleep_error),
                            listing=None if held is None else Listing(held, aborting), number=self.report_number)
            try:
                # Bounded: a call to a router killed under it can stay unanswered for good (Serve's
                # handle does not always fail it), and past replica_timeout_s the router has taken
                # this replica for dead anyway. A late answer's orders are lost replies: the held
                # listing recovers their work.
                orders = await asyncio.wait_for(self.router.pull.remote(report), self.cfg.router.replica_timeout_s)
            except Exception as e:  # router restarting or overloaded: keep the deltas, retry
                log.warning("pull failed (%r); retrying", e)
                self.pull_failed = True
                await asyncio.sleep(0.5)
                first = True
                continue
            self.unsent = []
            first = self.pull_failed = False
            self.router_id = orders.router_id
            try:
                for order in orders.control:
                    await self._control(order)
                moves = self._moves_in_progress()
                if orders.start and moves:
                    # The router sends no work while a load or a sleep move runs, as far as it knows:
                    # a wake that came while the engine still went to sleep reports (0, 0), as an
                    # awake replica does. Start it on the engine those moves leave, never beside them.
                    await asyncio.gather(*moves, return_exceptions=True)
                    if self.sleep_level or self.sleep_error or self.broken or self.sleep_goal:
                        # The moves left no engine awake with its weights (a deep wake's reload
                        # failed, say): run nothing. The next listing lacks this work, and the
                        # router sends it elsewhere.
                        orders.start = []
                for work in orders.start:
                    self.engine.submit(work)
                    self.dispatched[(work.seq_id, work.attempt)] = orders.router_id
                if orders.report_whole:  # before the abort's final report; an ended one's again, whole
                    self.engine.report_whole(orders.report_whole)
                self._delivered(report.progress)
                if orders.give_up:
                    await self.engine.give_up(orders.give_up)
            except Exception as e:
                if self.engine.dead is not None:  # the orders met a dead engine: hand back, as above
                    await self._leave_dead_engine()
                    return
                self.loop_error = e
                log.exception("replica %s failed applying orders", self.replica_id)
                raise
            urgent = (orders.work_waiting or bool(orders.give_up) or bool(orders.report_whole)
                      or bool(self.engine.aborting()))
            await self._pace(now, ended, urgent, orders.report_interval_s)

    def _delivered(self, progress: list) -> None:
        """These reports reached the router (and its answer was applied: it may ask for an ended
        segment's final again, whole): the engine may drop what it kept for their finals."""
        self.engine.forget_finals(progress)
        for p in progress:
            if p.finish_reason:
                self.dispatched.pop((p.seq_id, p.attempt), None)

    def _as_sent(self, p):
        """A final report as it goes to the router: whole after a failed pull (the router may have
        restarted) or when another router than the one answering now started the segment; the
        new router never got the earlier deltas, and continues the sequence from the whole output
        (router_adoption.py); an old router that was only slow drops the part it already has."""
        if not p.finish_reason:
            return p
        by = self.dispatched.get((p.seq_id, p.attempt))
        if self.pull_failed or (by is not None and by != self.router_id):
            return self.engine.whole_final(p)
        return p

    async def _pace(self, reported_t: float, ended: int, urgent: bool, interval_s: float = 0.0) -> None:
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
        the router's pulls otherwise; the freed slot idles at most that long (docs/benchmarks.md)."""
        engine = self.engine
        if not engine.held():  # (when the last one ends, `ended` changes: the pace ends too)
            return
        interval = interval_s or self.cfg.router.report_interval_s
        deadline, urgent_from = reported_t + interval, reported_t + URGENT_REPORT_GAP_FRAC * interval
        while not self.stopping and (now := time.monotonic()) < deadline:
            if engine.dead is not None:
                return  # its sequences continue elsewhere: say goodbye now
            if engine.ended != ended:
                if not engine.held():
                    return  # an idle replica pulls at once: the router holds that pull
                if urgent and now >= urgent_from:
                    return
            await asyncio.sleep(PACE_TICK_S)

    async def _leave_dead_engine(self) -> None:
        """The engine died under its sequences: say goodbye with what they made since the last
        report, so that the router continues them elsewhere at once, from their last tokens (not
        after router.replica_timeout_s), and stop; check_health then has Serve replace the replica."""
        self.loop_error = RuntimeError(f"the engine died: {type(self.engine.dead).__name__}: {self.engine.dead}")
        self.unsent += self.engine.drain()
        report = self._goodbye(engine_dead=True)
        try:
            await asyncio.wait_for(self.router.pull.remote(report), HAND_BACK_S)
            self.unsent = []
        except Exception as e:  # the router requeues them after router.replica_timeout_s instead
            log.warning("replica %s: engine died and its goodbye failed (%r)", self.replica_id, e)

    def _goodbye(self, engine_dead: bool = False) -> Report:
        """The last report: everything not yet sent, marked leaving (the router requeues the rest)."""
        if hasattr(self, "dispatched"):  # (the pull loop ran) finals whole where another router may take them
            self.unsent = [self._as_sent(p) for p in self.unsent]
        return Report(self.replica_id, self.incarnation, progress=self.unsent, stats=self.engine.stats(),
                      model=None, capacity=self.engine.capacity,
                      weights=WeightsState(version=self.weights_version), leaving=True, engine_dead=engine_dead)

    async def _control(self, order: ControlOrder) -> None:
        if isinstance(order, LoadWeights):
            if order.version in (self.weights_version, self.loading and self.loading[0]):
                return  # a resent order of what is done or under way
            # In the background: the replica keeps pulling (and reporting `loading`), so a load longer
            # than router.replica_timeout_s does not look like a dead replica. After any load or
            # sleep move in progress, never beside it.
            before = self._moves_in_progress()
            task = asyncio.get_running_loop().create_task(self._load_weights(order.path, order.version, before))
            self.loading = (order.version, task)
        elif isinstance(order, NoteWeights):  # asleep: the router orders the load at wake; keep it for a new router
            if order.version > max(self.weights_version, self.noted[0]):
                self.noted = (order.version, order.path)
        elif isinstance(order, (Sleep, Wake)):
            goal = order.level if isinstance(order, Sleep) else 0
            failed = self.sleep_error is not None and (self.sleep_task is None or self.sleep_task.done())
            if goal == self.sleep_goal and not failed:
                return  # a resent order of what is done or under way (a failed move is tried again)
            self.sleep_goal, self.sleep_error = goal, None
            before = [t for t in (self.sleep_task, self.loading and self.loading[1]) if t]
            reload = order if isinstance(order, Wake) else None
            self.sleep_task = asyncio.get_running_loop().create_task(self._move_sleep(goal, reload, before))

    def _moves_in_progress(self) -> list:
        """The weights load and the sleep move still running (each waits for those before it)."""
        return [t for t in (self.loading and self.loading[1], self.sleep_task) if t and not t.done()]

    def _reload_source(self) -> Optional[str]:
        """Where a level-2 sleeper reloads its weights from at wake: the latest checkpoint, else the
        config's model if it is a local checkpoint (None: nowhere; "" for a simulated engine)."""
        eng = self.cfg.engine
        if eng.kind == "sim":
            return ""
        if self.weights_path:
            return self.weights_path if os.path.isdir(self.weights_path) else None
        model = self.cfg.model_path()
        return model if os.path.isdir(model) and eng.load_format != "dummy" else None

    async def _move_sleep(self, goal: int, reload: Optional[Wake], before: list) -> None:
        """Sleep at `goal`, or wake (goal 0) and, from level 2, reload the weights the wake order
        names (the router's current version) before reporting awake. In the background, like a load:
        the replica keeps pulling, and reports `sleep_goal` until `sleep_level` reaches it."""
        if before:
            await asyncio.gather(*before, return_exceptions=True)
        try:
            if goal:
                if goal == 2 and self._reload_source() is None:
                    source = self.weights_path or f"engine.model={self.cfg.engine.model!r}"
                    raise SleepRefused(f"level 2 drops the weights, and {source} (load_format "
                                       f"{self.cfg.engine.load_format!r}) is no local checkpoint to reload them "
                                       "from at wake: use level 1, or update_weights first")
                try:
                    await self.engine.sleep(goal)
                except SleepRefused:
                    raise
                except Exception as e:  # vLLM may have freed part of its memory: nothing it holds is trusted
                    self.broken = RuntimeError(f"vLLM failed going to sleep at level {goal}: {e}")
                    raise
            else:
                was = self.sleep_level
                await self.engine.wake()
                if was == 2:
                    try:
                        await self._reload_after_deep_sleep(reload or Wake(None, self.weights_version))
                    except Exception as e:  # level 2 dropped the weights: without a reload there are none
                        self.broken = RuntimeError(f"no weights after a level-2 sleep: {e}")
                        raise
            if await self.engine.sleeping() != bool(goal):  # the engine's own word, not ours
                raise RuntimeError(f"the engine says it is {'awake' if goal else 'still asleep'}")
            self.sleep_level = goal
        except Exception as e:
            log.exception("replica %s: %s failed", self.replica_id, f"sleep(level={goal})" if goal else "wake")
            self.sleep_error = (f"replica {self.replica_id}: {f'sleep(level={goal})' if goal else 'wake'}: "
                                f"{type(e).__name__}: {e}")

    async def _reload_after_deep_sleep(self, order: Wake) -> None:
        version = order.version
        path = order.path or self._reload_source()
        if version == 0 and not order.path:  # the config's model: no checkpoint version to report
            if path:
                await self.engine.load_weights(path)
            return
        await self._load_weights(path, version)
        if self.weights_error and self.weights_error_version == version:
            raise RuntimeError(self.weights_error)

    async def _load_weights(self, path: str, version: int, before=()) -> None:
        try:
            if before:
                await asyncio.gather(*before, return_exceptions=True)
            await self.engine.load_weights(path)
        except Exception as e:
            log.exception("replica %s: load_weights %r failed", self.replica_id, path)
            self.weights_error = f"replica {self.replica_id}: load_weights({path!r}): {e}"
            self.weights_error_version = version
            if isinstance(e, WeightsLoadBroken):
                self.broken = e  # the engine's weights are unknown: check_health has Serve restart it
        else:
            self.weights_version, self.weights_path, self.weights_error = version, path, None
            if self.noted[0] <= version:
                self.noted = (0, "")
        finally:
            if self.loading and self.loading[0] == version:  # not a later load's flag
                self.loading = None

    async def info(self) -> dict:
        return {"replica_id": self.replica_id, "incarnation": self.incarnation, "model": self.model.__dict__}

    def check_health(self) -> None:
        if self.task.done():
            raise RuntimeError(f"pull loop stopped: {self.loop_error or self.task.exception()}")
        if self.broken is not None:
            raise RuntimeError(f"restart needed: {self.broken}")

    async def __del__(self):
        """Serve calls this when it scales the deployment down or replaces the replica: hand the
        work back (partial tokens included) so that it continues elsewhere at once, then stop."""
        self.stopping = True
        if getattr(self, "task", None) is not None:
            try:
                await asyncio.wait_for(self._hand_back(), HAND_BACK_S)
            except Exception as e:  # the router requeues it after router.replica_timeout_s instead
                log.warning("replica %s could not hand its work back (%r)", self.replica_id, e)
        await self.engine.shutdown()

    async def _hand_back(self) -> None:
        """Stop pulling, give up every sequence, wait for their partials, send them in a last
        report marked `leaving`."""
        router = self.cfg.router
        wait = min(HAND_BACK_S / 2, max(router.pull_wait_s, router.idle_pull_wait_s) + 1.0)
        # The loop ends after the pull in flight (held up to idle_pull_wait_s, longer in a large
        # fleet: then the wait runs out and the task is cancelled), unless the router is gone.
        try:
            await asyncio.wait_for(asyncio.shield(self.task), wait)
        except asyncio.TimeoutError:
            self.task.cancel()  # its pull's deltas are still in self.unsent; whatever it holds is handed back below
            self.pull_failed = True  # whether that pull reached a router (which) is unknown
        except Exception:
            pass  # the loop's error is logged; what it held is still handed back
        held = self.engine.held()
        if held:
            await self.engine.give_up(held)
        while self.engine.held():
            self.unsent += self.engine.drain()
            await asyncio.sleep(0.01)
        self.unsent += self.engine.drain()
        report = self._goodbye()
        # With nothing to hand back the goodbye only saves the router a timeout; when the whole
        # application is being deleted the router may be gone already: do not wait long for it.
        try:
            await asyncio.wait_for(self.router.pull.remote(report), HAND_BACK_S / 2 if report.progress else 1.0)
        except Exception as e:
            if report.progress:
                raise
            log.info("replica %s held no work; its goodbye did not reach the router (%r)", self.replica_id, e)
            return
        log.info("replica %s handed back %d sequences", self.replica_id, len(held))
