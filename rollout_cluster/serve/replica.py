"""EngineReplica deployment: hosts one engine and pulls work from the Router.

The replica is the Serve side only: it makes the engine, starts the pull loop (pull_loop.py) over
the engine's weight and sleep moves (engine_moves.py), answers Serve's health checks, and on a
graceful stop hands its work back. Ray Serve restarts a crashed replica; the new one has a new
incarnation and the router requeues the old one's sequences from their last reported tokens.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid

from ray import serve

from ..config import load_config
from ..engines.factory import make_engine
from ..security.secrets import read_keys
from ..security.signed_router import SignedRouter
from ..security.signing import Signer
from .app_name import serve_app_name
from .engine_moves import EngineMoves
from .pull_loop import HAND_BACK_S, PullLoop
from .router_link import RouterLink
from .timeline import Timeline

log = logging.getLogger("ray.serve")


def replica_rank() -> int:
    ctx = serve.get_replica_context()
    rank = getattr(ctx, "rank", 0)
    return int(getattr(rank, "rank", rank) or 0)


@serve.deployment
class EngineReplica:
    async def __init__(self, router, config: dict):
        self.cfg = load_config(config)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.incarnation = uuid.uuid4().hex[:8]
        # registers with a signed order; every report carries the credential it got
        signer = Signer(read_keys(self.cfg.security), app=serve_app_name() or "")
        self.link = RouterLink(SignedRouter(router, signer), self.replica_id,
                               self.incarnation)
        self.engine = make_engine(self.cfg, replica_rank())
        self.model = await self.engine.start()
        self._start_loop()

    def _start_loop(self) -> None:
        """The engine's moves and the pull loop over them, run on this (the engine's) event loop."""
        self.moves = EngineMoves(self.engine, self.cfg, self.replica_id)
        self.timeline = Timeline.from_env(f"replica-{self.replica_id}")
        if self.timeline is not None:
            self.timeline.start_probe()
        self.pull_loop = PullLoop(self.engine, self.moves, self.link.pull,
                                  replica_id=self.replica_id, incarnation=self.incarnation, model=self.model,
                                  router_cfg=self.cfg.router, timeline=self.timeline)
        self.task = asyncio.get_running_loop().create_task(self.pull_loop.run())

    def check_health(self) -> None:
        """Fails once the pull loop ended: the engine died, applying orders failed, or the router
        declared the replica stalled (PullLoop.stalled); Serve then replaces the replica."""
        if self.pull_loop.stalled or self.task.done():
            raise RuntimeError(f"pull loop stopped: {self.pull_loop.error or self.task.exception()}")
        if self.moves.broken is not None:
            raise RuntimeError(f"restart needed: {self.moves.broken}")

    async def __del__(self):
        """Serve calls this when it scales the deployment down or replaces the replica: hand the
        work back (partial tokens included) so that it continues elsewhere at once, then stop. A
        replica the router declared stalled hands nothing back: its work already runs elsewhere."""
        if getattr(self, "task", None) is not None and self.pull_loop.stalled:
            log.warning("replica %s was declared stalled: its work continued elsewhere, none is handed back",
                        self.replica_id)
        elif getattr(self, "task", None) is not None:
            self.pull_loop.stop()
            try:
                await asyncio.wait_for(self._hand_back(), HAND_BACK_S + 1.0)  # (_hand_back keeps to HAND_BACK_S)
            except Exception as e:  # the router requeues it after router.replica_timeout_s instead
                log.warning("replica %s could not hand its work back (%r)", self.replica_id, e)
        if getattr(self, "timeline", None) is not None:
            self.timeline.close()
        await self.engine.shutdown()

    async def _hand_back(self) -> None:
        """Stop pulling, give up every sequence, wait for their partials, send them in a last
        report marked `leaving`."""
        router = self.cfg.router
        start = time.monotonic()  # half the time for the pull in flight and the engine's give-ups, half for the goodbye
        wait = min(HAND_BACK_S / 2, max(router.pull_wait_s, router.idle_pull_wait_s) + 1.0)
        # The loop ends after the pull in flight (held up to idle_pull_wait_s, longer in a large
        # fleet: then the wait runs out and the task is cancelled), unless the router is gone.
        try:
            await asyncio.wait_for(asyncio.shield(self.task), wait)
        except asyncio.TimeoutError:
            self.task.cancel()  # its pull's deltas are still unsent; whatever it holds is handed back below
            self.pull_loop.pull_abandoned()
        except Exception:
            pass  # the loop's error is logged; what it held is still handed back
        held = self.engine.held()
        left = max(0.0, HAND_BACK_S / 2 - (time.monotonic() - start))
        report = self.pull_loop.goodbye(await self.pull_loop.give_up_all(left))
        # With nothing to hand back the goodbye only saves the router a timeout; when the whole
        # application is being deleted the router may be gone already: do not wait long for it.
        try:
            await asyncio.wait_for(self.link.pull(report), HAND_BACK_S / 2 if report.progress else 1.0)
        except Exception as e:
            if report.progress:
                raise
            log.info("replica %s held no work; its goodbye did not reach the router (%r)", self.replica_id, e)
            return
        log.info("replica %s handed back %d sequences", self.replica_id, len(held))
