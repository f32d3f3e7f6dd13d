"""Router deployment: one replica, asyncio, the single owner of sequence state.

Replicas long-poll `pull(report)`: orders go back at once when there are any, otherwise after
`pull_wait_s`, or `idle_pull_wait_s` for a replica that holds nothing (sooner when work arrives;
longer in a fleet past `max_pulls_per_s`). Every answer names the report interval for the fleet.
Drivers call `submit` and long-poll `fetch`.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid

from ray import serve

from ..config import load_config
from ..engines.cost_model import load_profile
from .fleet_target import expected_replicas
from .metrics import PrometheusRouterMetrics
from .router_credentials import ReplicaCredentials
from .router_status import status_of
from .push_watch import PushWatch
from .router_weight_orders import checked_abort, checked_checkpoint, checked_push
from .stall_watch import StallWatch
from ..niceness import set_niceness
from ..policy import make_policy
from ..router.core import STALLED, NoLiveReplicaError, RouterCore
from ..router.limits import BatchLimits
from ..protocol import LimitExceeded, Orders, Report, check_wait_s
from ..security.secrets import read_keys
from ..security.nonce_journal import GcsKV
from ..security.nonce_journal import attach as attach_journal
from ..security.signing import OrderRefused, OrderVerifier
from .app_name import serve_app_name

log = logging.getLogger("ray.serve")
# A new router's first batch (and one that names a weights version newer than it knows) waits this
# long after the first replica reports, for the others: twice the longest report interval a fleet is told.
WEIGHTS_LEARN_WAIT_S = 10.0


def _app_name():
    """The Serve app this router serves; None outside a Serve replica (the class built directly)."""
    return serve_app_name()


@serve.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
class Router:
    def __init__(self, config: dict):
        self.cfg = cfg = load_config(config)
        warning = set_niceness(cfg.router.niceness, "router.niceness", all_threads=True)
        if warning:
            log.warning(warning)
        cost = load_profile(cfg.profile_path(), cfg.engine.max_num_seqs)
        self.metrics = PrometheusRouterMetrics(cfg.metrics.port)
        self.work_ready: dict = {}  # replica_id -> Event: set when its outbox or the queue gains work
        self.batch_progress: dict = {}  # batch_id -> Event
        self.submit_t: dict = {}  # batch_id -> router clock at submission, while tracing (trace alignment)
        # Which router process this is: a restart (which loses every live batch) changes it.
        self.router_id, self.started_t = uuid.uuid4().hex[:12], time.monotonic()
        # The fleet it waits for: Serve's live target (a scale() before a restart), else the config's
        expected = expected_replicas(cfg.replicas)
        self.core = RouterCore(make_policy(cfg.policy, cost), expected, cfg.router.replica_timeout_s, self.metrics,
                               id_prefix=self.router_id[:6] + "-", limits=BatchLimits.of(cfg.limits),
                               id_salt=lambda: secrets.token_hex(8),  # a batch's id is its capability: unguessable
                               stall_timeout_s=cfg.router.stall_timeout_s, max_sessions=cfg.router.max_sessions,
                               engine_error_retries=cfg.router.engine_error_retries)
        self.stalls = StallWatch(self.core)  # replicas that pull on while their engine makes no progress
        self.push_watch = PushWatch(self.core)  # the trainer of a streamed push still coming: alive?
        # Control orders are signed (security/signing.py); each replica reports with the credential
        # register() gave it, so that no other caller can speak for it.
        sec = cfg.security
        # (orders bound to another app that shares the keys are refused: wrong_app)
        self.verifier = OrderVerifier(read_keys(sec), sec.max_clock_skew_s, sec.allow_unsigned_control,
                                      app=_app_name() or cfg.app_name)
        # ... and remembers the nonces its predecessors accepted (a restart is no replay window)
        app = _app_name()
        self.journal = None if app is None else attach_journal(
            self.verifier, GcsKV(f"rollout_cluster.nonces.{app}"), int(time.time() * 1000), log.warning, hook=False)
        self.creds = ReplicaCredentials(self.verifier, self.metrics)
        self.credentials = self.creds.issued  # replica_id -> the credential it reports with
        self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _order(self, order, op: str) -> dict:
        """The arguments of a control order, or OrderRefused (counted by reason). Its nonce is
        journaled before it runs (in a thread: the GCS may be slow, and pulls go on meanwhile; a
        replay to this router is refused from memory at once)."""
        try:
            args = self.verifier.check(order, op, time.time())
        except OrderRefused as e:
            self.metrics.refused(e.reason)
            log.warning("%s", e)
            raise
        if self.journal is not None:
            await asyncio.to_thread(self.journal.accepted, order.nonce, order.issued_ms)
        return args

    async def register(self, order) -> str:
        """A replica's signed request for its report credential (serve/router_credentials.py)."""
        return self.creds.register(await self._order(order, "register"))

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                self._reap_once(time.monotonic())
            except Exception:  # (never the reaper's end: it expires dead replicas and stalls)
                log.exception("the router's once-a-second check failed; it runs again in a second")

    def _reap_once(self, now: float) -> None:
        """Replicas that stopped pulling, the push watch, stalled replicas, abandoned and finished
        batches; then whoever waits for what changed is woken (held pulls for work queued, drivers'
        fetches for sequences finished: a cancelled one of a dead replica, the queue failed)."""
        mark = self._mark()
        dead = self.core.expire(now)
        if dead:
            log.warning("replicas %s stopped pulling; their sequences were requeued", dead)
            for rid in dead:
                self.work_ready.pop(rid, None)
                self.creds.forget(rid)  # (a dead replica's credential is no longer good)
            self._wake_all()
        try:
            died = self.push_watch.tick()
            if died:
                self._abort_push(*died, now)
        except Exception:  # (the rest of the check still runs)
            log.exception("the push watch failed; a streamed push whose trainer died waits out the replicas' stall limit")
        stalled = self.stalls.tick(now)
        if stalled:
            self._wake_all()  # their work is queued: the others take it now (a held pull of theirs ends)
            for rid in stalled:
                self.work_ready.pop(rid, None)
                self.creds.forget(rid)
        dropped = self.core.drop_abandoned(now, self.cfg.router.abandoned_batch_s)
        for bid in dropped:  # (the reasons kept are the latest DROPPED_KEPT: a larger tick outruns them)
            log.warning("batch %s: %s", bid, self.core.batches.dropped.get(bid, "dropped as abandoned"))
            self.batch_progress.pop(bid, None)
            self.submit_t.pop(bid, None)
        if dropped:
            self._wake_all()  # give-up orders for the replicas that ran them
        for bid in self.core.drop_finished(now, self.cfg.router.finished_batch_keep_s):
            self.submit_t.pop(bid, None)  # (fetched whole; its driver never fetched from its end)
        self._after(mark)
        self.metrics.gauges(self.core, now)

    def _mark(self) -> tuple:
        """What a change is measured against (_after): sequences queued and finished, ever."""
        return self.core.queue.pushed, self.core.moves.finished_count

    def _after(self, mark: tuple) -> None:
        pushed, finished = mark
        if self.core.queue.pushed != pushed:  # (an adoption wait's end, a dead replica's work)
            self._wake_all()
        if self.core.moves.finished_count != finished:
            self._notify_batches()

    def _wake_all(self) -> None:
        for ev in self.work_ready.values():
            ev.set()

    def _notify_batches(self) -> None:
        for ev in self.batch_progress.values():
            ev.set()

    async def pull(self, report: Report) -> Orders:
        if not isinstance(report, Report) or not self.creds.known(report):
            return Orders(register=True)  # nothing applied: the replica registers and sends it again
        now = time.monotonic()
        core = self.core
        applied = core.apply(report, now)
        if applied.stalled:  # declared now or before: its work continues elsewhere; it stops
            if applied.finished:  # (its cancelled sequences ended with it)
                self._notify_batches()
            if applied.replica_id is not None:
                self.stalls.note([report.replica_id])
                self.work_ready.pop(report.replica_id, None)
                self._wake_all()
            # (one that missed this answer registers again, and hears it again)
            self.creds.forget(report.replica_id)
            return Orders(stop=STALLED, router_id=self.router_id)
        if applied.finished:
            self._notify_batches()
        if applied.requeued:  # requeued work (give-up partials): held pulls take it now
            self._wake_all()
        if applied.left:  # its work is back in the queue: the others take it now
            log.info("replica %s left; its sequences were requeued", report.replica_id)
            self.work_ready.pop(report.replica_id, None)
            self.creds.forget(report.replica_id)
            self._wake_all()
            return Orders()
        if applied.replica_id is None:
            return Orders()  # a late pull of a replica that left
        orders = core.decide(report.replica_id, now, timer=time.perf_counter)
        core.trace_pull(report.replica_id, now)
        for rid in core.outbox.replica_ids():  # the decision left orders for others (give-ups)
            if rid in self.work_ready:
                self.work_ready[rid].set()
        if not orders:
            ev = self.work_ready.setdefault(report.replica_id, asyncio.Event())
            ev.clear()
            rep = core.fleet.replicas.get(report.replica_id)
            # a load's or a sleep move's end is news: pull again soon
            moving = report.sleep.level != report.sleep.goal and not report.sleep.error
            busy = (rep is not None and rep.seqs) or report.weights.loading or moving
            wait = self.cfg.router.pull_wait_s if busy else self.cfg.router.idle_pull_wait_for(len(core.fleet.replicas))
            try:
                await asyncio.wait_for(ev.wait(), wait)
            except asyncio.TimeoutError:
                pass
            orders = core.decide(report.replica_id, time.monotonic(), timer=time.perf_counter)
        orders.report_interval_s = self.cfg.router.report_interval_for(len(core.fleet.replicas))
        orders.router_id = self.router_id
        return orders

    async def submit(self, requests: list, wait_for_replica_s: float | None = None,
                     weights_version: int | None = None, previous_ids: list | None = None) -> str:
        """Queue a batch; returns its id. Waits up to `wait_for_replica_s` for a replica that says
        which model it runs and, for a fresh or restarted router, at most WEIGHTS_LEARN_WAIT_S
        more to hear the fleet's weights from every replica it expects (and `weights_version`);
        a batch on other weights is refused (WeightsVersionError)."""
        check_wait_s("wait_for_replica_s", wait_for_replica_s)
        wait = self.cfg.router.submit_wait_for_replica_s if wait_for_replica_s is None else wait_for_replica_s
        deadline = time.monotonic() + wait
        core, learn_until = self.core, None
        while True:
            now = time.monotonic()
            ready = bool(core.fleet.replicas) and core.model is not None
            if ready and core.weights_learned(weights_version, now):
                break
            if ready:  # replicas report their weights as they join: the rest join soon or hold the same
                learn_until = learn_until or now + WEIGHTS_LEARN_WAIT_S
                if now >= min(learn_until, deadline):
                    break  # core.submit refuses it, naming both versions
            elif now >= deadline:
                what = (f"{len(core.fleet.replicas)} replicas pull, but none has said which model it runs"
                        if core.fleet.replicas else "no live engine replica")
                raise NoLiveReplicaError(
                    f"{what} after {wait:.0f} s (router.submit_wait_for_replica_s): "
                    "the batch was not run; check that the engine replicas started")
            await asyncio.sleep(0.1)
        try:
            bid = core.submit(requests, time.monotonic(), weights_version=weights_version, previous_ids=previous_ids)
        except LimitExceeded as e:
            self.metrics.batch_refused(e.limit)
            raise
        if self.core.trace is not None:
            self.submit_t[bid] = self.core.batches[bid].submitted_t
        self.batch_progress[bid] = asyncio.Event()
        self._wake_all()
        if self.core.batches[bid].order:
            self.batch_progress[bid].set()
        return bid

    async def submit_batch(self, requests: list, wait_for_replica_s: float | None = None,
                           weights_version: int | None = None, previous_ids: list | None = None) -> dict:
        """`submit`, answering {"batch_id", "weights_version"}: the version the batch runs on,
        which a driver asks for again if it must resubmit after a router restart (with the
        sequences' `previous_ids` under the router that restarted)."""
        bid = await self.submit(requests, wait_for_replica_s, weights_version, previous_ids)
        return {"batch_id": bid, "weights_version": self.core.batches[bid].weights_version}

    async def fetch(self, batch_id: str, cursor: int = 0, wait_s: float = 1.0) -> tuple:
        """(new completions, cursor, done). Waits up to `wait_s` for something new."""
        check_wait_s("wait_s", wait_s, allow_none=False)
        done, new_cursor = False, cursor
        new, new_cursor, done = self.core.fetch(batch_id, cursor, time.monotonic())
        if not new and not done:
            ev = self.batch_progress.setdefault(batch_id, asyncio.Event())
            ev.clear()
            try:
                await asyncio.wait_for(ev.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
            new, new_cursor, done = self.core.fetch(batch_id, cursor, time.monotonic())
        if done:  # kept for a retry of this answer, until a fetch from its end (router/batches.py)
            self.batch_progress.pop(batch_id, None)
        return new, new_cursor, done

    async def cancel(self, order) -> int:
        n = self.core.cancel((await self._order(order, "cancel"))["batch_id"], time.monotonic())
        self._wake_all()
        self._notify_batches()
        return n

    async def update_weights(self, order) -> int:
        """Order every replica to load `path` as `version` (between batches); returns the version.
        The path must resolve under one of security.checkpoint_roots and be a complete checkpoint
        (docs/checkpoints.md), or the fleet keeps its weights and the caller gets why."""
        args = await self._order(order, "update_weights")
        path = await checked_checkpoint(self, args)
        v = self.core.update_weights(path, args.get("version"), running=args.get("running") or "finish",
                                     now=time.monotonic())
        self._wake_all()  # idle replicas are long-polling: give them the order now
        return v

    async def push_weights(self, order, buckets: list, lease=None) -> int:
        """Order every replica to load the pushed tensors in `buckets` (object-store handles of
        transfer/buckets.py's buckets, the trainer's, in order) as `version`, between batches;
        returns the version. The signed order names the buckets' object ids: others are refused.
        `lease`: the trainer's (transfer/lease.py), watched while a streamed push's objects still
        come: if the trainer dies, the push is aborted (serve/push_watch.py)."""
        args = await self._order(order, "push_weights")
        source = checked_push(self, args, buckets)
        v = self.core.update_weights(source, args.get("version"), tuple(buckets), args.get("running") or "finish",
                                     now=time.monotonic(), total=args.get("objects"))
        log.info("push_weights: version %d, %s tensors, %s bytes in %d buckets", v, args.get("tensors"),
                 args.get("bytes"), len(buckets))
        if lease is not None and self.core.weights.total is not None:  # (streamed: more to come)
            self.push_watch.watch(source, lease)
        self._wake_all()
        return v

    async def push_more(self, order, buckets: list) -> int:
        """The later buckets of the push the fleet is at (the trainer puts them while the replicas
        load the first ones): handed to every replica ordered it. Returns how many objects the
        push has now. The signed order names their object ids and where they start."""
        args = await self._order(order, "push_more")
        source = checked_push(self, args, buckets)
        n = self.core.control.push_more(source, args.get("start"), tuple(buckets))
        self._wake_all()
        return n

    async def push_abort(self, order) -> dict:
        """The trainer failed before its streamed push's last objects were put: the fleet goes back to
        the weights it held before (RouterCore.abort_push), each replica's load of the push stops at
        once (reloading those weights where it had begun replacing them) instead of waiting out
        bucket_stream.STALL_S. {"aborted": version or None, "version": the fleet's now}."""
        source, reason = checked_abort(await self._order(order, "push_abort"))
        return self._abort_push(source, reason, time.monotonic())

    def _abort_push(self, source: str, reason: str, now: float) -> dict:
        out = self.core.abort_push(source, reason, now)
        if out["aborted"] is not None:
            self._notify_batches()  # (a batch that named the aborted version failed)
            log.warning("push_abort: version %d (%s) aborted (%s); the fleet is back at version %d",
                        out["aborted"], source, reason, out["version"])
        self._wake_all()
        return out

    async def sleep(self, order) -> int:
        """Put every engine to sleep (vLLM sleep mode, between batches); returns the level."""
        level = self.core.sleep_fleet((await self._order(order, "sleep")).get("level", 1))
        self._wake_all()
        return level

    async def wake(self, order) -> None:
        await self._order(order, "wake")
        self.core.wake_fleet()
        self._wake_all()

    async def reset_prefix_cache(self) -> int:
        """Every engine drops its prefix cache (TRL's /reset_prefix_cache); returns how many replicas
        were ordered. No signed order: it changes no output and no fleet state, only prefill work,
        so the HTTP token that may already run batches may ask it (docs/security.md)."""
        n = self.core.reset_prefix_cache()
        self._wake_all()
        return n

    async def weights_digest(self, detail: bool = False) -> str:
        """Every replica digests its weights at its next pull (router/digests.py); returns the ask's
        id for weights_digests. Refused during a load or sleep. No signed order: it changes nothing."""
        ask = self.core.digests.request(detail)
        self._wake_all()
        return ask

    async def weights_digests(self, ask: str) -> dict:
        """The answers to `ask` so far: {"ask", "replicas": {replica_id: answer}, "waiting": [...]}."""
        return self.core.digests.answers(ask)

    async def set_fleet_target(self, order) -> int:
        """RolloutClient.scale told Serve to run `replicas`: the count static and chunked use."""
        args = await self._order(order, "set_fleet_target")
        self.core.set_fleet_target(args.get("replicas"), time.monotonic())
        self._wake_all()  # (what static and chunked decide changes with it)
        return self.core.fleet.expected

    async def status(self) -> dict:
        return status_of(self)

    async def set_trace(self, order) -> None:
        """Record (time, replica, sequences held) at every pull: benchmarks plot it."""
        self.core.trace = [] if (await self._order(order, "set_trace")).get("on", True) else None
        self.submit_t.clear()

    async def take_trace(self, batch_id: str) -> list:
        """The recorded trace with times relative to `batch_id`'s submission; clears it."""
        t0 = self.submit_t.pop(batch_id, 0.0)
        out = [(t - t0, rid, n) for t, rid, n in (self.core.trace or [])]
        if self.core.trace is not None:
            self.core.trace = []
        return out

    async def take_step_samples(self) -> list:
        """The (running, context tokens, seconds per token per sequence) reports recorded while tracing; clears them."""
        out, self.core.step_samples = self.core.step_samples, []
        return out

    async def set_policy(self, order) -> str:
        """Swap the policy between batches (benchmarks run every policy on one cluster)."""
        from ..config import PolicyConfig

        policy = (await self._order(order, "set_policy")).get("policy")
        if not isinstance(policy, dict):
            raise TypeError(f"policy={policy!r}: must be a mapping")
        if self.core.seqs:
            raise RuntimeError("set_policy: a batch is running; switch policies between batches")
        pc = PolicyConfig(**policy)
        self.cfg.policy = pc
        self.cfg.validate()
        self.core.policy = make_policy(pc, load_profile(self.cfg.profile_path(), self.cfg.engine.max_num_seqs))
        self.core.decision_times.clear()
        self.core.counters.__init__()  # (the components hold this object: reset it in place)
        return pc.name
