"""PushWatch: the router's look, once a second, at the trainer of the streamed push it waits on.

A streamed push's order comes with its first bucket and the trainer sends the rest (push_more).
A trainer that fails tells the router (push_abort); one that dies tells nobody. Its order came
with its lease (transfer/lease.py: an actor that dies with the trainer's process and node): while
the push is still coming, the watch keeps one ping of the lease in flight and, when Ray answers
that the lease died, aborts the push as the trainer would have (RouterCore.abort_push: the fleet
goes back to the weights it held, each replica's load stops at once). Without the watch each
replica waits bucket_stream.STALL_S (60 s) for the next bucket first.

Only a definite death counts (ActorDiedError, not one of a lease that could not start: that says
nothing of the trainer): a lease that is unreachable for a while (ActorUnavailableError, a busy
node) or not started yet is pinged again. A push whose order came without a lease (an older
client, or none could be made) is left to STALL_S.
"""
from __future__ import annotations

import logging
from typing import Optional

from ..router.core import RouterCore

log = logging.getLogger("ray.serve")


class PushWatch:
    def __init__(self, core: RouterCore):
        self.core = core  # the router's core: it decides, this only looks
        self.source: Optional[str] = None  # the streamed push watched ("push://<id>"), None: none
        self.lease = None  # its trainer's lease (an actor handle of transfer/lease.TrainerLease)
        self.ping = None  # the ping in flight (a concurrent Future of lease.alive), None: none yet
        self.said = False  # a failed ping of this push's lease is in the log already (once a push)

    def watch(self, source: str, lease) -> None:
        """The fleet now waits on the streamed push `source`, whose trainer holds `lease`."""
        self.source, self.lease, self.ping, self.said = source, lease, None, False

    def coming(self) -> bool:
        """The watched push is the fleet's and some of its objects have not come."""
        w = self.core.weights
        return self.source is not None and w.path == self.source and w.total is not None

    def tick(self) -> Optional[tuple[str, str]]:
        """(the watched push, why it must be aborted: its trainer died), or None. Sends the next
        ping when the last one was answered."""
        if not self.coming():
            self._forget()
            return None
        if self.ping is None:
            self.ping = self._send()
            return None
        if not self.ping.done():
            return None
        err = self.ping.exception()
        from ray.exceptions import ActorDiedError

        if isinstance(err, ActorDiedError) and not err.actor_init_failed:
            source = self.source
            self._forget()
            return source, f"the trainer's process died before the push's last objects came ({_first_line(err)})"
        if isinstance(err, ActorDiedError):  # (it never started: the trainer's fate is unknown)
            log.warning("push %s: its trainer's lease could not start (%s); the push is not watched", self.source,
                        _first_line(err))
            self._forget()
            return None
        if err is not None and not self.said:
            self.said = True
            log.info("push %s: its trainer's lease did not answer (%s); asking again", self.source, _first_line(err))
        self.ping = self._send()
        return None

    def _forget(self) -> None:
        self.source, self.lease, self.ping = None, None, None

    def _send(self):
        try:
            return self.lease.alive.remote().future()
        except Exception as e:  # (a handle that cannot be called at all: treated as a ping that failed)
            from concurrent.futures import Future

            failed: Future = Future()
            failed.set_exception(e)
            return failed


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]
