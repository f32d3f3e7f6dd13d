"""What the router tells engines to be, beside the work it hands out: which weights they hold
(update_weights) and whether they sleep (vLLM sleep mode). RouterCore mixes this in.

Both follow one rule: the router keeps the fleet's target, a replica reports where its engine
is, an order goes out once per replica (again only when a lost reply took it), and a replica
that is not at the target gets no work. Both change between batches only, so that a batch never
mixes weights and never waits on a sleeping engine.
"""
from __future__ import annotations

from typing import Optional

from .fleet_sleep import SLEEP_LEVELS, FleetSleep
from .state import ReplicaState
from .protocol import InputError, LoadWeights, NoteWeights, Orders, Report, Sleep, Wake, WeightsVersionError, is_int


class EngineControl:
    """Weights and sleep. Needs RouterCore's replicas, seqs, outbox, queue and _finish."""

    def _init_control(self) -> None:
        # Weights: a batch runs on one version. update_weights only between batches; a replica
        # that does not hold the current version gets a load order and no work until it does.
        self.weights_version = 0
        self.weights_path: Optional[str] = None
        self.weights_errors: dict = {}  # replica_id -> why its load failed
        # A fresh router (a restart) learns the weights from the replicas until a driver first
        # submits or updates: the highest version any reports holding or noted while asleep.
        self.weights_learning = True
        self.sleep = FleetSleep()

    def usable(self, rep: ReplicaState) -> bool:
        """It may get work: it holds the current weights, loads no others, and is awake."""
        return (rep.weights_version == self.weights_version and not rep.weights_loading
                and self.sleep.awake(rep.replica_id))

    def update_weights(self, path: str, version: Optional[int] = None) -> int:
        """Point every replica at the weights in `path` (a checkpoint directory on the replicas'
        nodes) as `version` (default: the current one + 1). Between batches only, so that a batch
        never mixes versions. Replicas load at their next pull; returns the version."""
        if not isinstance(path, str) or not path.strip():
            raise InputError("path", path, "must be the path of a checkpoint directory")
        if version is None:
            version = self.weights_version + 1
        if not is_int(version) or version <= self.weights_version:
            raise InputError("version", version, f"must be an integer above the current version {self.weights_version}")
        self._refuse_while_running("update_weights", "weights change between batches")
        self._refuse_while_loading("update_weights")
        self.weights_version, self.weights_path, self.weights_learning = version, path, False
        self.weights_errors.clear()
        for rep in self.replicas.values():
            self._order_weights(rep)
        return version

    def weights_status(self) -> dict:
        return {"version": self.weights_version, "path": self.weights_path,
                "replicas": {rid: r.weights_version for rid, r in self.replicas.items()},
                "errors": dict(self.weights_errors)}

    def _weights_report(self, rep: ReplicaState, report: Report, now: float) -> None:
        if (self.weights_learning or self.weights_path is None) and not self.seqs:
            # A restarted router: the replicas remember the weights it ordered, held or noted while
            # asleep; the highest of every report is the latest update (a batch that ran before the
            # restart is lost with the router, and none runs now: no batch mixes versions).
            for version, path in ((report.weights.version, report.weights.path),
                                  (report.weights.noted, report.weights.noted_path)):
                if version > self.weights_version and path:
                    self.weights_version, self.weights_path = version, path
                    self.weights_errors.clear()  # they were for an older version
        v = self.weights_version
        rep.weights_version, rep.weights_loading = report.weights.version, report.weights.loading
        if (rep.weights_noted == v and report.weights.noted != v and report.weights.version != v
                and not self._order_pending(rep.replica_id, (NoteWeights,))):
            rep.weights_noted = None  # the note was sent and the replica never saw it: again
        if rep.weights_version == v:
            self.weights_errors.pop(rep.replica_id, None)
        elif report.weights.error and report.weights.error_version == v:
            if rep.replica_id not in self.weights_errors:
                self.weights_errors[rep.replica_id] = report.weights.error
                self._fail_queued_if_no_replica_can_load(now)
        elif rep.weights_ordered == v and report.weights.loading != v and not self._order_pending(rep.replica_id):
            rep.weights_ordered = None  # the order was sent and the replica never saw it: again
        self._order_weights(rep)

    def check_batch_weights(self, version) -> None:
        """A batch that names its weights version runs on it or is refused: a trainer that updated
        to version v gets no sample of another version (after a router restart, another driver's
        update_weights). None: the batch runs on the current version."""
        if version is None:
            return
        if not is_int(version) or version < 0:
            raise InputError("weights_version", version, "must be an integer >= 0 (a version update_weights set), "
                             "or None for the current one")
        if version != self.weights_version:
            learning = (f"; this router is new (or restarted) and has learned it from {len(self.replicas)} "
                        "replica(s) so far"
                        if self.learning_weights_below(version) else "")
            raise WeightsVersionError("weights_version", version,
                                      f"the fleet's weights are version {self.weights_version} "
                                      f"({self.weights_path or 'the config model'!r}){learning}: the batch was not run")

    def learning_weights_below(self, version) -> bool:
        """A restarted router that may not have heard yet of `version` from its replicas."""
        return is_int(version) and self.weights_learning and version > self.weights_version

    def _refuse_while_learning_a_load(self) -> None:
        """A restarted router that has not settled on the weights, while a replica loads some (the
        router restarted during update_weights): a batch now would run on a version about to go."""
        if not self.weights_learning:
            return
        loading = sorted(rid for rid, r in self.replicas.items() if r.weights_loading)
        if loading:
            v = max(self.replicas[rid].weights_loading for rid in loading)
            raise RuntimeError(f"replica(s) {', '.join(loading[:4])} still load weights version {v}, ordered by a "
                               "router before this one restarted: wait until status()['weights'] shows them held, "
                               "or call update_weights again")

    def no_replica_can_load(self) -> bool:
        """Every live replica failed loading the current weights: none holds them, none still loads."""
        return bool(self.replicas) and all(rid in self.weights_errors for rid in self.replicas)

    def _fail_queued_if_no_replica_can_load(self, now: float) -> None:
        if self.no_replica_can_load():
            self._fail_queued(f"no replica holds weights version {self.weights_version} ({self.weights_path!r}): "
                              + "; ".join(sorted(self.weights_errors.values())), now)

    def _order_pending(self, replica_id: str, kinds: tuple = (LoadWeights,)) -> bool:
        orders = self.outbox.get(replica_id)
        return orders is not None and any(isinstance(order, kinds) for order in orders.control)

    def _refuse_while_loading(self, what: str) -> None:
        """Two loads at once on a replica: the second's could land while work runs."""
        v = self.weights_version
        loading = sorted(rid for rid, r in self.replicas.items()
                         if r.weights_ordered == v and r.weights_version != v and rid not in self.weights_errors)
        if loading:
            raise RuntimeError(f"{what}: version {v} ({self.weights_path!r}) is still loading on {len(loading)} "
                               f"replica(s) ({', '.join(loading[:4])}); wait until status()['weights'] shows it "
                               "held or failed everywhere")

    def _refuse_while_running(self, what: str, why: str) -> None:
        if self.seqs:
            batches = sorted({s.batch_id for s in self.seqs.values()})
            raise RuntimeError(f"{what}: {len(self.seqs)} sequences of batch(es) {', '.join(batches)} are "
                               f"unfinished; {why} (wait for them, or cancel)")

    def _order_weights(self, rep: ReplicaState) -> None:
        """Send `rep` the current weights once, if it does not hold them. An engine asleep (or on
        its way) loads after it wakes (a level-2 wake order carries the weights itself); it is sent
        a note of them meanwhile, which it reports back, so a router restarted before the wake
        still knows the update."""
        v = self.weights_version
        if self.weights_path is None or rep.weights_version == v or rep.weights_ordered == v:
            return
        if not self.sleep.awake(rep.replica_id):
            if rep.weights_noted != v:
                rep.weights_noted = v
                self.outbox.setdefault(rep.replica_id, Orders()).control.append(NoteWeights(self.weights_path, v))
            return
        rep.weights_ordered = v
        self.outbox.setdefault(rep.replica_id, Orders()).control.append(LoadWeights(self.weights_path, v))

    # ---- sleep ---------------------------------------------------------------------------
    def sleep_fleet(self, level: int = 1) -> int:
        """Put every engine to sleep at vLLM's `level` (1: weights to host memory, KV cache dropped;
        2: both dropped, reloaded from the latest checkpoint at wake), between batches. Replicas
        move at their next pull; a batch submitted before wake() is refused. Returns the level."""
        if not is_int(level) or level not in SLEEP_LEVELS:
            raise InputError("level", level, "must be 1 (offload the weights to host memory, drop the KV cache) "
                             "or 2 (drop both; waking reloads the latest checkpoint)")
        if self.sleep.level == level:  # again: the replicas that failed to get there try once more
            for rid in list(self.sleep.errors):
                self.sleep.errors.pop(rid)
                if rid in self.replicas:
                    self._order_sleep(self.replicas[rid])
            return level
        if self.sleep.level:
            raise RuntimeError(f"sleep: the engines are asleep at level {self.sleep.level} already; wake() first")
        self._refuse_while_running("sleep", "engines sleep between batches")
        self._refuse_while_loading("sleep")
        self.sleep.set(level)
        for rep in self.replicas.values():
            self._order_sleep(rep)
        return level

    def wake_fleet(self) -> None:
        """Wake every engine (a level-2 sleeper reloads the current weights first)."""
        if self.sleep.level == 0 and not self.sleep.errors:
            return
        self.sleep.set(0)
        for rep in self.replicas.values():
            self._order_sleep(rep)

    def sleep_status(self) -> dict:
        return self.sleep.status()

    def _refuse_while_asleep(self) -> None:
        if self.sleep.level:
            raise RuntimeError(f"the engines are asleep (level {self.sleep.level}, RolloutClient.sleep): call "
                               "wake() before submitting a batch")
        if self.sleep.errors and all(rid in self.sleep.errors for rid in self.replicas):
            raise RuntimeError("no engine woke: " + "; ".join(sorted(self.sleep.errors.values()))
                               + " (wake() again tries once more)")

    def _sleep_report(self, rep: ReplicaState, report: Report) -> None:
        pending = self._order_pending(rep.replica_id, (Sleep, Wake))
        # With an order on its way, the report's error is the old try's: the order tries again.
        self.sleep.record(rep.replica_id, report.sleep.level, report.sleep.goal, None if pending else report.sleep.error)
        if self.sleep.needs_order(rep.replica_id) and not pending:
            self._order_sleep(rep)  # it joined, or the reply that carried the order was lost

    def _order_sleep(self, rep: ReplicaState) -> None:
        """Replace any sleep or wake order still waiting for `rep` with the fleet's level."""
        orders = self.outbox.setdefault(rep.replica_id, Orders())
        orders.control = [order for order in orders.control if not isinstance(order, (Sleep, Wake))]
        if self.sleep.level:
            orders.control.append(Sleep(self.sleep.level))
        else:
            orders.control.append(Wake(self.weights_path, self.weights_version))
