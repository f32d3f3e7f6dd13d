"""The weight relay's waits and given-up steps (relay.py holds one `RelayWaits`).

Every blocking wait of a relay step (a rendezvous, a receive, the fleet's commit) is told here
(`wait`): what it waits for and how long it may take (`waiting`), so that the runner's watchdog
(serve/protocols/relay_runner.py) can tell a step that is stuck (an NCCL receive has no timeout
of its own). A step the watchdog gives up (`give_up`) owns nothing from then on: its thread is
remembered, and whatever that thread does if its wait ever ends is discarded (`GivenUp`, raised
as its wait ends, however it ended), so that no handler of the step touches the relay again.
Threads are remembered, not idents: those are reused.
"""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

__all__ = ["GivenUp", "RelayWaits", "Waiting"]


class GivenUp(RuntimeError):
    """Raised in a step whose communicator was given up while it waited: what it did is dropped."""


@dataclass(frozen=True)
class Waiting:
    """What a relay step is blocked on, read by the runner's watchdog."""
    what: str  # for the error: "tensor 'a.weight'", "the fleet's commit", ...
    since: float  # time.monotonic() when the wait began
    bound_s: float  # how long it may take; past that (and the runner's grace) the step is stuck
    thread: threading.Thread  # the waiting thread


class RelayWaits:
    """The blocking wait under way, and the threads whose step was given up."""

    def __init__(self):
        self.waiting: Optional[Waiting] = None  # the blocking wait under way, for the runner's watchdog
        self.progress_at = 0.0  # time.monotonic() when the last wait ended
        self.given_up: set = set()  # threads whose step was given up (not idents: those are reused)

    @contextmanager
    def wait(self, what: str, bound_s: float):
        """A blocking wait, told to the watchdog. Where its step was given up meanwhile, the wait
        ends in GivenUp, however it ended, so that no handler of the step touches the relay."""
        self.check_mine()
        mine = self.waiting = Waiting(what, time.monotonic(), bound_s, threading.current_thread())
        try:
            yield
        except Exception as e:
            self.check_mine(e)
            raise
        finally:
            if self.waiting is mine:
                self.waiting, self.progress_at = None, time.monotonic()
        self.check_mine()

    def give_up(self, thread: threading.Thread) -> None:
        """The step on `thread` is given up: it owns nothing from now on, and its wait is no longer watched."""
        self.given_up.add(thread)
        self.waiting = None

    def ended(self, thread: threading.Thread) -> None:
        """The given-up step on `thread` returned at last: nothing more of it to discard."""
        self.given_up.discard(thread)

    def mine(self) -> bool:
        """Whether the calling thread's step still owns the relay (was not given up)."""
        return threading.current_thread() not in self.given_up

    def check_mine(self, cause: Optional[BaseException] = None) -> None:
        if not self.mine():
            raise GivenUp("this step's communicator was given up while it waited") from cause
