"""RelayRunner: the weight relay's blocking steps (transfer/relay.py) on one worker thread, in the
order their requests came, and a watchdog that gives up a step stuck past its bound, so that a
trainer that died mid-broadcast cannot hold the relay (and every later request) for good. The
HTTP routes that queue the steps are in trl_weights.py."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import weakref
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional

from ...transfer.relay import RelayTimeout, Waiting, WeightRelay

log = logging.getLogger("ray.serve")


@dataclass
class Step:
    """One relay step, queued in the order its request came."""
    method: str  # the WeightRelay method
    args: tuple  # its arguments
    future: Future = field(default_factory=Future)  # its outcome: the route's answer, or background()'s callback
    started: Optional[float] = None  # time.monotonic() when a worker took it; None while queued
    thread: Optional[threading.Thread] = None  # that worker


class RelayRunner:
    """The relay's blocking steps on one worker thread, in the order the requests came, and a
    watchdog that gives up a step stuck past its bound.

    An NCCL receive has no timeout: a trainer that dies mid-broadcast leaves it waiting for ever,
    and behind it every later step (a restarted trainer's init, /reset_prefix_cache/). The
    watchdog looks every `poll_s` at what the running step waits for (WeightRelay.waits.waiting: a
    tensor or the rendezvous, `timeout_s`; the fleet's commit, `commit_timeout_s`) or, between
    waits, at the step itself (`timeout_s`); `grace_s` past that bound, the relay gives its
    communicator up (WeightRelay.give_up: what it staged dropped, nothing the stuck thread does
    later kept) and aborts it (NcclChannel.abort: ncclCommAbort ends the waiting kernel), the
    step answers RelayTimeout (a route: 504, naming what timed out; a background step: the next
    request), and a fresh worker takes the queue on. Python cannot kill the stuck thread: it is
    abandoned, a daemon, until its wait returns (the abort's doing, or the channel's) or the
    process ends."""

    grace_s = 5.0  # past a wait's bound before the watchdog acts: a CPU channel's own timeout raises first
    poll_s = 0.5  # how often the watchdog looks

    def __init__(self, relay: WeightRelay):
        self.relay = relay
        self.steps: queue.SimpleQueue = queue.SimpleQueue()  # Steps not yet taken, in request order
        self.lock = threading.Lock()  # the worker's hand-offs against the watchdog's give-up
        self.running: Optional[Step] = None  # the step a worker runs, or None
        self.worker: Optional[threading.Thread] = None  # the one worker whose results count
        self.pending: Counter = Counter()  # method -> its steps queued or running
        self.abandoned = 0  # workers given up so far
        self._start_worker()
        threading.Thread(target=self._watch, args=(weakref.ref(self),), name="weight-relay-watchdog",
                         daemon=True).start()

    def submit(self, method: str, *args) -> Future:
        step = Step(method, args)
        with self.lock:
            self.pending[method] += 1
        step.future.add_done_callback(lambda _: self._forget(method))
        self.steps.put(step)
        return step.future

    def _forget(self, method: str) -> None:
        with self.lock:
            self.pending[method] -= 1

    async def call(self, method: str, *args):
        """The step's outcome; bounded by the watchdog (RelayTimeout), however long those before it hung."""
        return await asyncio.wrap_future(self.submit(method, *args))

    def background(self, method: str, *args) -> None:
        """A step the client does not wait for (TRL <= 1.10's); its failure is raised by the next call."""
        def done(f):
            if not f.cancelled() and f.exception() is not None:
                if self.relay.error is None:  # the first failure: those after follow from it
                    self.relay.error = f"{method}: {f.exception()}"
                log.warning("weight relay: %s failed: %s", method, f.exception())

        self.submit(method, *args).add_done_callback(done)

    def check(self) -> None:
        """Gives up the running step where its wait (or, between waits, the step) passed its bound."""
        relay, now = self.relay, time.monotonic()
        with self.lock:
            step = self.running
            if step is None:
                return
            waiting = relay.waits.waiting
            if waiting is None or waiting.thread != step.thread:
                waiting = Waiting(f"its own work ({step.method})", max(step.started, relay.waits.progress_at),
                                  relay.timeout_s, step.thread)
            if now - waiting.since <= waiting.bound_s + self.grace_s:
                return
            error = RelayTimeout(step.method, waiting.what, waiting.bound_s)
            channel = relay.give_up(step.thread, str(error))
            self.running, self.worker, self.abandoned = None, None, self.abandoned + 1  # its outcome is no one's
        log.error("weight relay: %s (%s abandoned, a fresh worker takes the next step)", error, step.thread.name)
        step.future.set_exception(error)  # a background step's callback sets relay.error first
        try:  # NCCL's abort ends the stuck kernel, which would otherwise hold the device up
            if channel is not None and hasattr(channel, "abort"):
                channel.abort()
        except Exception as e:  # noqa: BLE001 - the thread stays abandoned all the same
            log.warning("weight relay: aborting the given-up communicator failed: %s", e)
        with self.lock:
            self._start_worker()

    @staticmethod
    def _watch(ref) -> None:
        while (runner := ref()) is not None:
            runner.check()
            poll, runner = runner.poll_s, None  # no reference held while asleep
            time.sleep(poll)

    def _start_worker(self) -> None:
        self.worker = threading.Thread(target=self._work, name=f"weight-relay-{self.abandoned}", daemon=True)
        self.worker.start()

    def _work(self) -> None:
        me = threading.current_thread()
        while True:
            step = self.steps.get()
            if not step.future.set_running_or_notify_cancel():  # its client went away while it was queued
                continue
            with self.lock:
                step.started, step.thread, self.running = time.monotonic(), me, step
            try:
                result, error = getattr(self.relay, step.method)(*step.args), None
            except BaseException as e:  # noqa: BLE001 - the step's answer
                result, error = None, e
            with self.lock:
                if self.worker is not me:  # given up meanwhile: its future is answered, its outcome is no one's
                    log.warning("weight relay: the abandoned %s returned (%s), too late", step.method,
                                error or "ok")
                    self.relay.waits.ended(me)  # nothing more of it to discard
                    return
                self.running = None
            if error is None:
                step.future.set_result(result)
            else:
                step.future.set_exception(error)
