"""The fleet's weights: which version batches run on, and which replicas hold it.

update_weights points the fleet at a checkpoint as a new version, between batches only, so that
a batch never mixes versions. Every replica that does not hold it gets one LoadWeights order
(again only when a lost reply took it) and no work until it reports the version held. An engine
asleep gets a NoteWeights instead and loads at wake; it reports the note back, so a router
restarted during the sleep still knows the update. A fresh router (a restart) learns the version
from the replicas' reports until a driver first submits or updates: the highest any replica holds
or noted is the latest update.

Plain state, no clock, no I/O: RouterCore passes the reports in and sends the orders out.
"""
from __future__ import annotations

from typing import Optional

from ..protocol import InputError, LoadWeights, NoteWeights, WeightsState, WeightsVersionError, is_int
from .state import ReplicaState


class FleetWeights:
    def __init__(self):
        self.version = 0  # the version batches run on (0: the config's model)
        self.path: Optional[str] = None  # where it comes from (None: the config's model)
        self.errors: dict[str, str] = {}  # replica_id -> why its load of `version` failed
        # A fresh router learns the version from the replicas until a driver submits or updates.
        self.learning = True

    # ---- a driver's orders ---------------------------------------------------------------------
    def checked(self, path: str, version: Optional[int]) -> int:
        """The version an update to `path` would make (default: the current one + 1), or InputError."""
        if not isinstance(path, str) or not path.strip():
            raise InputError("path", path, "must be the path of a checkpoint directory")
        if version is None:
            version = self.version + 1
        if not is_int(version) or version <= self.version:
            raise InputError("version", version, f"must be an integer above the current version {self.version}")
        return version

    def update(self, path: str, version: int) -> None:
        """Point the fleet at `path` as `version` (checked). The caller made sure that no batch runs
        and no load is under way."""
        self.version, self.path, self.learning = version, path, False
        self.errors.clear()

    def check_batch(self, version, replicas: int) -> None:
        """A batch that names its weights version runs on it or is refused: a trainer that updated
        to version v gets no sample of another version (after a router restart, another driver's
        update_weights). None: the batch runs on the current version."""
        if version is None:
            return
        if not is_int(version) or version < 0:
            raise InputError("weights_version", version, "must be an integer >= 0 (a version update_weights set), "
                             "or None for the current one")
        if version != self.version:
            learning = (f"; this router is new (or restarted) and has learned it from {replicas} replica(s) so far"
                        if self.learning_below(version) else "")
            raise WeightsVersionError("weights_version", version,
                                      f"the fleet's weights are version {self.version} "
                                      f"({self.path or 'the config model'!r}){learning}: the batch was not run")

    def learning_below(self, version) -> bool:
        """A restarted router that may not have heard yet of `version` from its replicas."""
        return is_int(version) and self.learning and version > self.version

    # ---- a replica's report --------------------------------------------------------------------
    def learn(self, w: WeightsState) -> None:
        """A restarted router, with no batch running: take the highest version a replica holds or
        noted while asleep (a batch that ran before the restart is lost with the router, and none
        runs now: no batch mixes versions)."""
        if not self.learning and self.path is not None:
            return
        for version, path in ((w.version, w.path), (w.noted, w.noted_path)):
            if version > self.version and path:
                self.version, self.path = version, path
                self.errors.clear()  # they were for an older version

    def record(self, rep: ReplicaState, w: WeightsState, load_pending: bool, note_pending: bool) -> bool:
        """What the replica reports holding. `load_pending`/`note_pending`: an order of that kind
        waits in its outbox. Returns whether its load of the current version just failed."""
        v = self.version
        rep.weights_version, rep.weights_loading = w.version, w.loading
        if rep.weights_noted == v and w.noted != v and w.version != v and not note_pending:
            rep.weights_noted = None  # the note was sent and the replica never saw it: again
        if rep.weights_version == v:
            self.errors.pop(rep.replica_id, None)
        elif w.error and w.error_version == v:
            if rep.replica_id not in self.errors:
                self.errors[rep.replica_id] = w.error
                return True
        elif rep.weights_ordered == v and w.loading != v and not load_pending:
            rep.weights_ordered = None  # the order was sent and the replica never saw it: again
        return False

    def order_for(self, rep: ReplicaState, awake: bool) -> Optional[LoadWeights | NoteWeights]:
        """The order `rep` needs now, once: a load if it does not hold the version, or a note of it
        while its engine sleeps (or moves to or from sleep). None: nothing to send."""
        v = self.version
        if self.path is None or rep.weights_version == v or rep.weights_ordered == v:
            return None
        if not awake:
            if rep.weights_noted == v:
                return None
            rep.weights_noted = v
            return NoteWeights(self.path, v)
        rep.weights_ordered = v
        return LoadWeights(self.path, v)

    def forget(self, replica_id: str) -> None:
        self.errors.pop(replica_id, None)

    # ---- what the fleet can do -----------------------------------------------------------------
    def held_by(self, rep: ReplicaState) -> bool:
        """It holds the current version and loads no other."""
        return rep.weights_version == self.version and not rep.weights_loading

    def none_can_load(self, replicas: dict) -> bool:
        """Every live replica failed loading the current weights: none holds them, none still loads."""
        return bool(replicas) and all(rid in self.errors for rid in replicas)

    def failure(self) -> str:
        """Why no replica can run work, naming each replica's load error."""
        return (f"no replica holds weights version {self.version} ({self.path!r}): "
                + "; ".join(sorted(self.errors.values())))

    def loading(self, replicas: dict) -> list[str]:
        """Replicas ordered to load the current version that neither hold it nor failed yet."""
        v = self.version
        return sorted(rid for rid, r in replicas.items()
                      if r.weights_ordered == v and r.weights_version != v and rid not in self.errors)

    def status(self, replicas: dict) -> dict:
        return {"version": self.version, "path": self.path,
                "replicas": {rid: r.weights_version for rid, r in replicas.items()},
                "errors": dict(self.errors)}
