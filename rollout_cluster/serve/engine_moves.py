"""EngineMoves: what a replica's engine is told to be beside its work, the weights it holds and
whether it sleeps (vLLM sleep mode), moved by the router's control orders.

Invariants:
- A move runs in the background: the replica keeps pulling (and reporting `loading`, or the sleep
  `goal` it has not reached), so a move longer than router.replica_timeout_s does not look like a
  dead replica.
- Moves run one after another, never beside each other: each waits for those ordered before it.
- A resent order of what is done or under way starts nothing; a failed sleep move is tried again.
- `broken` is set when a failure left the engine's weights or memory unknown: no work starts, the
  pull loop says goodbye (PullLoop.leave_broken_engine), and the replica's health check has Serve
  restart it.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Optional

from ..config import ClusterConfig
from ..engines.base import SleepRefused, WeightsLoadBroken
from ..transfer.bucket_stream import BucketStream, fetched  # noqa: F401 (fetched: the replica's reader of a push)
from ..transfer.push import PUSH_SCHEME
from ..protocol import (ControlOrder, DigestWeights, LoadWeights, NoteWeights, ResetPrefixCache, Sleep, SleepState,
                        StopPush, Wake, WeightsDigest, WeightsState)

log = logging.getLogger("ray.serve")
STOPPED_KEPT = 16  # aborted pushes a replica remembers (EngineMoves.stopped_reasons)


class EngineMoves:
    def __init__(self, engine, cfg: ClusterConfig, replica_id: str):
        self.engine, self.cfg, self.replica_id = engine, cfg, replica_id
        # the weights the engine holds (0, "": the config's model), and why the last load failed
        self.weights_version, self.weights_path = 0, ""
        self.weights_buckets: Optional[BucketStream] = None  # a pushed version's buckets (a level-2 wake reloads them)
        self.weights_handed: dict[str, int] = {}  # how their load handed its buckets to vLLM's worker (WeightsState.handed)
        self.weights_error: Optional[str] = None
        self.weights_error_version = 0  # the version that failed load was for (an older error is stale)
        self.weights_error_path = ""  # ... and its source
        # (version, asyncio.Task, path) of a load in progress; the path because a restarted router may
        # number other weights the same
        self.loading = None
        self.noted = (0, "")  # (version, path) of an update ordered while asleep: loaded at wake
        self.noted_buckets: Optional[BucketStream] = None  # a noted push's buckets (a restarted router has lost them)
        self.streams: dict[str, BucketStream] = {}  # push source -> its objects as they came (transfer/bucket_stream.py)
        self.stopped_push = ""  # the last push a StopPush ended here (WeightsState.stopped)
        # the last STOPPED_KEPT pushes stopped here -> why: an order of one that comes after its
        # StopPush (a wake's reload built once the engine woke, a late LoadWeights) fails at once
        self.stopped_reasons: dict[str, str] = {}
        # vLLM sleep mode: the level the engine is at, the one the router last ordered, why reaching
        # it failed, and the move under way (it runs after any load or move before it)
        self.sleep_level, self.sleep_goal = 0, 0
        self.sleep_error: Optional[str] = None
        self.sleep_task: Optional[asyncio.Task] = None
        self.broken: Optional[Exception] = None
        self.cache_reset = ("", 0)  # (router, number) of the last ResetPrefixCache taken (a resent one starts nothing)
        self.digest_ask = ""  # the last DigestWeights taken (a resent one starts nothing)
        self.digest: Optional[WeightsDigest] = None  # its answer, until a report delivered it
        self._chores: set = set()  # the cache drops and digests under way (asyncio keeps only weak references)
        self._handlers = {LoadWeights: self._load, NoteWeights: self._note, ResetPrefixCache: self._reset_cache,
                          DigestWeights: self._digest, StopPush: self._stop_push,
                          Sleep: lambda order: self._move(order.level, None), Wake: lambda order: self._move(0, order)}

    # ---- the replica's view ---------------------------------------------------------------------
    def apply(self, order: ControlOrder) -> None:
        """Start the move `order` asks for (in the background, on the running event loop)."""
        handler = self._handlers.get(type(order))
        if handler is None:
            log.warning("replica %s: ignored an unknown control order %r", self.replica_id, order)
            return
        handler(order)

    def in_progress(self) -> list:
        """The weights load and the sleep move still running (each waits for those before it)."""
        return [t for t in (self.loading and self.loading[1], self.sleep_task) if t and not t.done()]

    async def ready_for_work(self) -> bool:
        """Wait for the moves under way: work never starts beside them. False when they left no engine awake with
        its weights (a deep wake's reload failed, say), or when the load it waited for failed: work
        sent with a load (running="keep") is labelled with that load's version, and the engine
        still holds the old one. Then run nothing; the next listing lacks that work, and the router
        sends it elsewhere. With no move under way, True unless the engine is `broken` (its weights
        are a mix: the pull loop says goodbye at its next step, PullLoop.leave_broken_engine)."""
        moves = self.in_progress()
        if not moves:
            return self.broken is None
        # (the router sends no work while a move runs, as far as it knows: a wake behind a sleep
        # under way is reported as waking, `states`; work sent before a move began waits here)
        loading = (self.loading[0], self.loading[2]) if self.loading else None
        await asyncio.gather(*moves, return_exceptions=True)
        if loading is not None and (self.weights_version, self.weights_path) != loading:
            return False
        return not (self.sleep_level or self.sleep_error or self.broken or self.sleep_goal)

    def states(self) -> tuple[WeightsState, SleepState]:
        """The report's WeightsState and SleepState."""
        weights = WeightsState(version=self.weights_version, error=self.weights_error,
                               error_version=self.weights_error_version, error_path=self.weights_error_path,
                               loading=self.loading[0] if self.loading else 0, path=self.weights_path,
                               loading_path=self.loading[2] if self.loading else "",
                               noted=self.noted[0], noted_path=self.noted[1], handed=dict(self.weights_handed),
                               objects=len(self.streams.get(self.loading[2] if self.loading else self.noted[1], ())),
                               stopped=self.stopped_push)
        level = self.sleep_level
        if level == self.sleep_goal == 0 and self.sleep_task is not None and not self.sleep_task.done():
            # a wake behind a sleep still under way: the engine is going to sleep and back (a level-2
            # one reloads its weights), not awake; reported as waking, so the router sends no work
            level = 1
        return weights, SleepState(level=level, goal=self.sleep_goal, error=self.sleep_error)

    def reload_source(self) -> Optional[str]:
        """Where a level-2 sleeper reloads its weights from at wake: the latest checkpoint, else the
        config's model if it is a local checkpoint (None: nowhere; "" for a simulated engine)."""
        eng = self.cfg.engine
        if eng.kind == "sim":
            return ""
        if self.weights_path:
            if self.weights_buckets is not None:  # pushed: reloaded from the buckets it came in
                return self.weights_path
            return self.weights_path if os.path.isdir(self.weights_path) else None
        model = self.cfg.model_path()
        return model if os.path.isdir(model) and eng.load_format != "dummy" else None

    # ---- the orders -----------------------------------------------------------------------------
    def _load(self, order: LoadWeights) -> None:
        # A resent order of what is done or under way starts nothing: the same number from the same
        # source (a router that restarted may give the number to other weights, which do load).
        loading = (self.loading[0], self.loading[2]) if self.loading else None
        buckets = self._stream(order.path, order.buckets)  # (a resent order of a push may name more of it)
        if (order.version, order.path) in ((self.weights_version, self.weights_path), loading):
            return
        before = self.in_progress()
        task = asyncio.get_running_loop().create_task(self._load_weights(order.path, order.version, before,
                                                                         buckets, order.keep))
        self.loading = (order.version, task, order.path)

    def _note(self, order: NoteWeights) -> None:
        """Asleep: the router orders the load at wake; kept (and reported) for a router that restarts."""
        buckets = self._stream(order.path, order.buckets)
        if (order.version, order.path) in ((self.weights_version, self.weights_path), self.noted):
            return  # (the same number from another source is other weights: noted)
        # Kept whatever its number: a router notes only its current version, in the order it made
        # them, so a number below the one held or noted is a restarted router's (this replica was
        # cut off from it while it numbered other weights): its word, which the wake loads.
        self.noted, self.noted_buckets = (order.version, order.path), buckets

    def _stream(self, path: str, buckets: Optional[tuple]) -> Optional[BucketStream]:
        """The push `path`'s objects as they came, with those `buckets` names added (None: not a
        push). Streams are kept for the pushes this replica holds, loads or noted, and this one."""
        if buckets is None:
            return None
        stream = self.streams.get(path)
        if stream is None:
            stream = self.streams[path] = BucketStream(path)
            if path in self.stopped_reasons:  # (its trainer aborted it before this order came)
                stream.stop(self.stopped_reasons[path])
        stream.offer(buckets)
        self._forget_streams(also=path)
        return stream

    def _forget_streams(self, also: str = "") -> None:
        """Drop the streams of pushes this replica neither holds, loads nor noted (nor `also`): their
        handles would keep a replaced version's buckets alive in the object store, a whole model's
        bytes on the trainer's node for every version kept."""
        keep = {also, self.weights_path, self.noted[1], self.loading[2] if self.loading else ""}
        for old in [p for p in self.streams if p not in keep]:
            del self.streams[old]

    def _stop_push(self, order: StopPush) -> None:
        """Its trainer aborted the push: a load of it fails at once (and reloads the weights held
        before, if it had begun replacing them: _load_weights), a note of it is dropped."""
        self.stopped_push = order.path
        reason = order.reason if isinstance(order.reason, str) else repr(order.reason)
        if order.path != self.weights_path:  # (not one it holds whole)
            self.stopped_reasons[order.path] = reason
            while len(self.stopped_reasons) > STOPPED_KEPT:
                self.stopped_reasons.pop(next(iter(self.stopped_reasons)))
            stream = self.streams.get(order.path)
            if stream is not None:
                stream.stop(reason)
        if self.noted[1] == order.path:
            self.noted, self.noted_buckets = (0, ""), None
        self._forget_streams()  # (a load of it keeps its stream until the load ends)

    def _move(self, goal: int, reload: Optional[Wake]) -> None:
        failed = self.sleep_error is not None and (self.sleep_task is None or self.sleep_task.done())
        if goal == self.sleep_goal and not failed:
            return  # a resent order of what is done or under way (a failed move is tried again)
        self.sleep_goal, self.sleep_error = goal, None
        before = [t for t in (self.sleep_task, self.loading and self.loading[1]) if t]
        self.sleep_task = asyncio.get_running_loop().create_task(self._move_sleep(goal, reload, before))

    def _reset_cache(self, order: ResetPrefixCache) -> None:
        router, number = self.cache_reset
        if order.router == router and order.number <= number:
            return  # resent (another router's order is new whatever its number: a restarted one counts from 1)
        self.cache_reset = (order.router, order.number)
        self._chore(self._drop_cache(self.in_progress()))

    def _digest(self, order: DigestWeights) -> None:
        if order.ask == self.digest_ask:
            return
        self.digest_ask = order.ask
        self._chore(self._take_digest(order, self.in_progress()))

    def _chore(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._chores.add(task)
        task.add_done_callback(self._chores.discard)

    def digest_delivered(self, answer: Optional[WeightsDigest]) -> None:
        """A report carrying `answer` reached the router: not sent again."""
        if answer is not None and answer is self.digest:
            self.digest = None

    # ---- the moves ------------------------------------------------------------------------------
    async def _take_digest(self, order: DigestWeights, before: list) -> None:
        """After the moves under way; an answer whose weights were not one version throughout (a
        load began, the engine sleeps) is an error, never a digest of a mix. Never fails the replica."""
        if before:
            await asyncio.gather(*before, return_exceptions=True)
        version, t0 = self.weights_version, time.perf_counter()
        answer = WeightsDigest(order.ask, version)
        try:
            if self.sleep_level or self.sleep_goal or self.broken or self.loading:
                raise RuntimeError("the engine sleeps, loads weights or lost them: ask again once it is awake "
                                   "and holds its weights")
            got = await self.engine.weights_digest(order.detail)
            if self.loading or self.weights_version != version or self.sleep_goal:
                raise RuntimeError("a weights load or a sleep began during the digest: ask again")
            answer.digest, answer.params = got["digest"], got.get("params") if order.detail else None
        except Exception as e:
            log.warning("replica %s: weights digest failed: %s", self.replica_id, e)
            answer.error = f"replica {self.replica_id}: weights digest: {type(e).__name__}: {e}"
        answer.seconds = round(time.perf_counter() - t0, 4)
        if self.digest_ask == order.ask:  # not a newer ask's place
            self.digest = answer

    async def _drop_cache(self, before: list) -> None:
        """After the moves under way (a load resets the cache itself); never fails the replica."""
        if before:
            await asyncio.gather(*before, return_exceptions=True)
        try:
            if not await self.engine.reset_prefix_cache():
                log.info("replica %s: the engine kept blocks that running requests hold", self.replica_id)
        except Exception:
            log.exception("replica %s: reset_prefix_cache failed", self.replica_id)

    async def _move_sleep(self, goal: int, reload: Optional[Wake], before: list) -> None:
        """Sleep at `goal`, or wake (goal 0) and, from level 2, reload the weights the wake order
        names (the router's current version) before reporting awake. `sleep_level` changes only
        when the engine itself says it reached `goal`."""
        if before:
            await asyncio.gather(*before, return_exceptions=True)
        try:
            if goal:
                await self._sleep(goal)
            else:
                await self._wake(reload)
            if await self.engine.sleeping() != bool(goal):  # the engine's own word, not ours
                raise RuntimeError(f"the engine says it is {'awake' if goal else 'still asleep'}")
            self.sleep_level = goal
        except Exception as e:
            what = f"sleep(level={goal})" if goal else "wake"
            log.exception("replica %s: %s failed", self.replica_id, what)
            if self.sleep_task is asyncio.current_task():  # (a move ordered since runs next: its outcome counts)
                self.sleep_error = f"replica {self.replica_id}: {what}: {type(e).__name__}: {e}"

    async def _sleep(self, level: int) -> None:
        if level == 2 and self.reload_source() is None:
            source = self.weights_path or f"engine.model={self.cfg.engine.model!r}"
            raise SleepRefused(f"level 2 drops the weights, and {source} (load_format "
                               f"{self.cfg.engine.load_format!r}) is no local checkpoint to reload them "
                               "from at wake: use level 1, or update_weights first")
        try:
            await self.engine.sleep(level)
        except SleepRefused:
            raise
        except Exception as e:  # vLLM may have freed part of its memory: nothing it holds is trusted
            self.broken = RuntimeError(f"vLLM failed going to sleep at level {level}: {e}")
            raise

    async def _wake(self, reload: Optional[Wake]) -> None:
        was = self.sleep_level
        await self.engine.wake()
        if was == 2:
            try:
                await self._reload_after_deep_sleep(reload or Wake(None, self.weights_version))
            except Exception as e:  # level 2 dropped the weights: without a reload there are none
                self.broken = RuntimeError(f"no weights after a level-2 sleep: {e}")
                raise

    async def _reload_after_deep_sleep(self, order: Wake) -> None:
        version = order.version
        path = order.path or self.reload_source()
        buckets = self._stream(order.path, order.buckets) if order.path else self.weights_buckets
        if version == 0 and not order.path:  # the config's model: no checkpoint version to report
            if path:
                await self.engine.load_weights(path)
                self.weights_handed = self._handed()
            return
        back = await self._load_weights(path, version, buckets=buckets)
        if self.weights_error and self.weights_error_version == version:
            if back is None and self.broken is None and (version, path) != (self.weights_version, self.weights_path):
                back = await self._reload_held()  # level 2 dropped the weights: the failed load left none
            if back is None:
                raise RuntimeError(self.weights_error)

    def _handed(self) -> dict[str, int]:  # the engine's last load's WeightsState.handed ({}: an engine that does not count)
        return dict(self.engine.handed()) if callable(getattr(self.engine, "handed", None)) else {}

    def kept_buckets(self, path: str) -> Optional[BucketStream]:
        """The buckets of the push `path` that this replica loaded or was noted (None: none kept).
        A restarted router names a push it learned from the replicas without its handles."""
        if path == self.weights_path and self.weights_buckets is not None:
            return self.weights_buckets
        return self.noted_buckets if path == self.noted[1] else None

    async def _reload_held(self) -> Optional[str]:
        """After a load that left the engine's weights a mix (a push stopped halfway, a bucket
        refused after the first went in): load again the version the replica held, from its push's
        buckets, its checkpoint or the config's model. Returns where from; None where there is
        nowhere (dummy weights, a push whose objects are gone) or that load failed too: the engine
        restarts then. Nothing runs on the engine meanwhile (a load runs between batches; a keep
        swap, which runs beside sequences, is not mended this way). It assumes what a failed load
        left unknown is the weights alone: every parameter is loaded again and the prefix cache
        reset; an engine broken otherwise fails this load too, and restarts."""
        path, buckets = self.weights_path, self.weights_buckets
        source = path if buckets is not None or (path and not path.startswith(PUSH_SCHEME)) else \
            (self.reload_source() if not path else None)
        if not source:
            return None
        try:
            if buckets is not None:
                await self.engine.load_tensors(fetched(buckets))
            else:
                await self.engine.load_weights(source)
        except Exception:
            log.exception("replica %s: reloading version %d from %r after a broken load failed too", self.replica_id,
                          self.weights_version, source)
            return None
        self.weights_handed = self._handed()
        log.warning("replica %s: a load broke the engine's weights; reloaded version %d from %r", self.replica_id,
                    self.weights_version, source)
        return source

    async def _load_weights(self, path: str, version: int, before=(), buckets: Optional[tuple] = None,
                            keep: bool = False) -> Optional[str]:
        """Load `path` as `version`; on failure record why. Returns where the version held before was
        reloaded from when the failed load had broken the engine's weights (_reload_held), else None."""
        # keep: swapped in under the running sequences, which report where (SeqProgress.swaps)
        keep_as = version if keep else None
        back = None
        try:
            if before:
                await asyncio.gather(*before, return_exceptions=True)
            if buckets is None and path.startswith(PUSH_SCHEME):
                buckets = self.kept_buckets(path)
            if buckets is not None:  # pushed tensors: fetched bucket by bucket while the engine loads
                await self.engine.load_tensors(fetched(buckets), keep_as)
            elif path.startswith(PUSH_SCHEME):
                raise RuntimeError(f"the tensors of {path!r} are gone with the router that took them (it "
                                   "restarted): push the weights again")
            else:
                await self.engine.load_weights(path, keep_as)
        except Exception as e:
            log.exception("replica %s: load_weights %r failed", self.replica_id, path)
            self.weights_error = f"replica {self.replica_id}: load_weights({path!r}): {e}"
            self.weights_error_version, self.weights_error_path = version, path
            if isinstance(e, WeightsLoadBroken):  # a mix of old and new weights
                back = None if keep or (version, path) == (self.weights_version, self.weights_path) else \
                    await self._reload_held()
                if back is None:
                    self.broken = e  # the engine's weights are unknown: check_health has Serve restart it
                else:
                    self.weights_error += f"; the replica reloaded version {self.weights_version} from {back!r}"
        else:
            self.weights_version, self.weights_path, self.weights_error = version, path, None
            self.weights_buckets, self.weights_handed = buckets, self._handed()
            if self.noted[0] <= version:
                self.noted, self.noted_buckets = (0, ""), None
        finally:
            if self.loading and (self.loading[0], self.loading[2]) == (version, path):  # not a later load's flag
                self.loading = None
            self._forget_streams()  # (the version this load replaced, or the push that failed to load)
        return back
