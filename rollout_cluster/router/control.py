"""What the router tells engines to be, beside the work it hands out: which weights they hold
(update_weights) and whether they sleep (vLLM sleep mode).

Both follow one rule: the router keeps the fleet's target (FleetWeights, FleetSleep), a replica
reports where its engine is, an order goes out once per replica (again only when a lost reply
took it), and a replica that is not at the target gets no work. Both change between batches
only, so that a batch never mixes weights and never waits on a sleeping engine.

No clock and no I/O: orders go into the outbox, and SeqMoves fails the queued work when no
replica can load the weights (apply_weights says when).
"""
from __future__ import annotations

from typing import Optional

from ..protocol import LoadWeights, NoteWeights, ResetPrefixCache, SleepState, Sleep, StopPush, Wake, WeightsState
from .fleet import Fleet
from .outbox import Outbox
from .sleep import FleetSleep
from .state import ReplicaState, SeqState
from .weights import FleetWeights


class FleetControl:
    def __init__(self, weights: FleetWeights, sleep: FleetSleep, fleet: Fleet, outbox: Outbox,
                 unfinished: dict[str, SeqState], id_prefix: str = ""):
        self.weights, self.sleep, self.fleet, self.outbox = weights, sleep, fleet, outbox
        self.id_prefix = id_prefix  # this router's (ResetPrefixCache.router)
        self.unfinished = unfinished  # the router's live sequences (read only): no change while they run
        self.cache_resets = 0  # reset_prefix_cache orders so far (numbers them)

    # ---- a driver's orders ---------------------------------------------------------------------
    def update_weights(self, path: str, version: Optional[int], buckets: Optional[tuple] = None,
                       in_flight: bool = False, keep: bool = False, now: Optional[float] = None,
                       total: Optional[int] = None) -> int:
        """Point every replica at the weights in `path` (a checkpoint directory on the replicas'
        nodes; or, with `buckets`, a push's tensors: push_weights) as `version` (default: above the
        current one and any a replica reported). Between batches only, so that a batch never mixes
        versions. Replicas load at their next pull; returns the version. `total`: a streamed push's
        objects in all (the rest follow with push_more)."""
        what = "push_weights" if buckets is not None else "update_weights"
        version = self.weights.checked(path, version)
        total = self.weights.total_checked(total, buckets or ()) if buckets is not None else None
        if not in_flight:  # (in flight: RouterCore gives the running sequences up)
            self._refuse_while_running(what, "weights change between batches (or pass running=keep / recompute / abort)")
        self._refuse_while_loading(what)
        self._refuse_until_heard(what, now)  # (last: a driver that retries it has nothing else to fix)
        self.weights.update(path, version, buckets, keep, total)
        for rep in self.fleet.replicas.values():
            self.order_weights(rep)
        self._rename_waiting_wakes()
        return version

    def abort_push(self, source: str, reason: str) -> Optional[int]:
        """Its trainer aborted the streamed push `source` before all its objects came
        (FleetWeights.abort): the fleet goes back to the version before it. Every replica is told
        (StopPush: a load of it stops, and reloads the weights held before if it had begun
        replacing them) in place of any order of the push not yet pulled, and gets what it lacks
        of the version gone back to. Returns the aborted version (None: nothing to abort)."""
        aborted = self.weights.abort(source, reason)
        if aborted is None:
            return None
        for rid, rep in self.fleet.replicas.items():  # (their weights_ordered/noted name a number never given again)
            orders = self.outbox.to(rid)
            of_it = [o for o in orders.control if isinstance(o, (LoadWeights, NoteWeights, Wake)) and o.path == source]
            orders.control = [o for o in orders.control if o not in of_it] + [StopPush(source, reason)]
            self.order_weights(rep)
            if any(isinstance(o, Wake) for o in of_it):
                self.order_sleep(rid)  # the wake it was to get, naming the weights gone back to
        return aborted

    def abort_unloadable_push(self) -> Optional[tuple[int, str, str]]:
        """A streamed push whose objects still come, and every live replica's load of it failed (its
        objects stopped coming: a trainer that hangs, or died without a lease; or a bucket every
        engine refused): nothing can hold it, and a trainer that is gone would never abort it, so
        the router does (abort_push), and the fleet serves the weights before it again. Returns
        (the aborted version, its source, why) or None: nothing to abort."""
        if self.weights.total is None or not self.weights.none_can_load(self.fleet.replicas):
            return None
        source = self.weights.path
        reason = ("every replica's load of it failed before its last object came: " + self.weights.failure())[:1000]
        aborted = self.abort_push(source, reason)
        return None if aborted is None else (aborted, source, reason)

    def push_more(self, source: str, start: int, buckets: tuple) -> int:
        """The current push's later buckets (FleetWeights.extend): every replica ordered or noted
        the push gets its order again, naming them. Returns how many objects the push has now."""
        n = self.weights.extend(source, start, buckets)
        for rep in self.fleet.replicas.values():
            self.order_weights(rep)
        self._rename_waiting_wakes()
        return n

    def checked(self, what: str, path: str, version: Optional[int], now: Optional[float] = None) -> int:
        """The version a weights order would take (FleetWeights.checked), or why not: InputError
        for a bad path or version, WeightsNotLearned (retryable) while a fresh router has not yet
        heard every replica's weights (weights_floor.py). `now`: the router's clock (None: none)."""
        version = self.weights.checked(path, version)
        self._refuse_until_heard(what, now)
        return version

    def sleep_fleet(self, level: int) -> int:
        """Put every engine to sleep at vLLM's `level` (1: weights to host memory, KV cache dropped;
        2: both dropped, reloaded from the latest checkpoint at wake), between batches. Replicas
        move at their next pull; a batch submitted before wake() is refused. Returns the level."""
        self.sleep.check_level(level)
        if self.sleep.level == level:  # again: the replicas that failed to get there try once more
            for rid in list(self.sleep.errors):
                self.sleep.errors.pop(rid)
                if rid in self.fleet.replicas:
                    self.order_sleep(rid)
            return level
        if self.sleep.level:
            raise RuntimeError(f"sleep: the engines are asleep at level {self.sleep.level} already; wake() first")
        self._refuse_while_running("sleep", "engines sleep between batches")
        self._refuse_while_loading("sleep")
        self.sleep.set(level)
        for rid in self.fleet.replicas:
            self.order_sleep(rid)
        return level

    def wake_fleet(self) -> None:
        """Wake every engine (a level-2 sleeper reloads the current weights first)."""
        if self.sleep.level == 0 and not self.sleep.errors and self.sleep.ordered:
            return  # (not ordered: a restarted router whose sleepers have not reported; the driver's wake holds)
        self.sleep.set(0)
        for rid in self.fleet.replicas:
            self.order_sleep(rid)

    def reset_prefix_cache(self) -> int:
        """Have every engine drop its prefix cache at its next pull (while sequences run too: an
        engine drops only the blocks no running sequence holds, as vLLM does). Returns how many
        replicas were ordered. A weights update resets the cache by itself."""
        self.cache_resets += 1
        order = ResetPrefixCache(self.cache_resets, self.id_prefix)
        for rid in self.fleet.replicas:
            self.outbox.replace_control(rid, (ResetPrefixCache,), order)
        return len(self.fleet.replicas)

    def refuse_batch(self, weights_version: Optional[int]) -> None:
        """Raise if a batch cannot run on the fleet's weights and sleep state now."""
        replicas = self.fleet.replicas
        self.weights.check_batch(weights_version, len(replicas))
        asleep = self.sleep.refusal(replicas)
        if asleep:
            raise RuntimeError(asleep)
        if self.weights.learning:  # a router restarted during update_weights: a batch now would run
            loading = sorted(rid for rid, r in replicas.items() if r.weights_loading)  # on a version about to go
            if loading:
                v = max(replicas[rid].weights_loading for rid in loading)
                raise RuntimeError(f"replica(s) {', '.join(loading[:4])} still load weights version {v}, ordered by "
                                   "a router before this one restarted: wait until status()['weights'] shows them "
                                   "held, or call update_weights again")

    def _refuse_until_heard(self, what: str, now: Optional[float]) -> None:
        self.weights.floor.check_heard(what, self.fleet.expected, now, self.fleet.replica_timeout_s)

    def _refuse_while_running(self, what: str, why: str) -> None:
        if self.unfinished:
            batches = sorted({s.batch_id for s in self.unfinished.values()})
            raise RuntimeError(f"{what}: {len(self.unfinished)} sequences of batch(es) {', '.join(batches)} are "
                               f"unfinished; {why} (wait for them, or cancel)")

    def _refuse_while_loading(self, what: str) -> None:
        """Two loads at once on a replica: the second's could land while work runs."""
        loading = self.weights.loading(self.fleet.replicas)
        if loading:
            raise RuntimeError(f"{what}: version {self.weights.version} ({self.weights.path!r}) is still loading on "
                               f"{len(loading)} replica(s) ({', '.join(loading[:4])}); wait until "
                               "status()['weights'] shows it held or failed everywhere")

    # ---- a replica's report --------------------------------------------------------------------
    def apply_sleep(self, rep: ReplicaState, state: SleepState) -> None:
        pending = self.outbox.pending(rep.replica_id, (Sleep, Wake))
        # With an order on its way, the report's error is the old try's: the order tries again.
        self.sleep.record(rep.replica_id, state.level, state.goal, None if pending else state.error)
        if self.sleep.needs_order(rep.replica_id) and not pending:
            self.order_sleep(rep.replica_id)  # it joined, or the reply that carried the order was lost

    def apply_weights(self, rep: ReplicaState, state: WeightsState, learn: bool) -> bool:
        """Take in what the replica holds (`learn`: no batch runs, a fresh router may learn the
        version) and send it what it lacks. Returns whether its load of the current version failed."""
        if learn:
            self.weights.learn(state)
        failed = self.weights.record(rep, state, self.outbox.pending(rep.replica_id, (LoadWeights,)),
                                     self.outbox.pending(rep.replica_id, (NoteWeights,)))
        stop = self.weights.still_on_aborted(state)
        if stop is not None and not self.outbox.pending(rep.replica_id, (StopPush,)):
            self.outbox.to(rep.replica_id).control.append(stop)  # (its first StopPush was lost with a reply)
        self.order_weights(rep)
        return failed

    def usable(self, rep: ReplicaState) -> bool:
        """It may get work: it holds the current weights, loads no others, and is awake."""
        return self.weights.held_by(rep) and self.sleep.awake(rep.replica_id)

    # ---- orders --------------------------------------------------------------------------------
    def order_weights(self, rep: ReplicaState) -> None:
        order = self.weights.order_for(rep, awake=self.sleep.awake(rep.replica_id))
        if order is None:
            return
        waiting = self.outbox.to(rep.replica_id).control
        for i, o in enumerate(waiting):  # the same order not yet pulled (a push's buckets grew): in its place
            if type(o) is type(order) and (o.path, o.version) == (order.path, order.version):
                waiting[i] = order
                return
        waiting.append(order)

    def _rename_waiting_wakes(self) -> None:
        """A Wake not yet pulled names the weights the fleet had when wake() was called: after a
        change it names the new ones (or the push's objects so far), so that a level-2 sleeper
        reloads the current version, once, not the old one and then the new."""
        for rid in self.fleet.replicas:
            if self.outbox.pending(rid, (Wake,)):
                self.order_sleep(rid)

    def order_sleep(self, replica_id: str) -> None:
        """Replace any sleep or wake order still waiting for the replica with the fleet's level."""
        self.outbox.replace_control(replica_id, (Sleep, Wake), self.sleep.order(self.weights.path, self.weights.version,
                                                                                self.weights.buckets))
