"""The fleet's weights: which version batches run on, and which replicas hold it.

update_weights points the fleet at a checkpoint as a new version, between batches only, so that
a batch never mixes versions. Every replica that does not hold it gets one LoadWeights order
(again only when a lost reply took it) and no work until it reports the version held. An engine
asleep gets a NoteWeights instead and loads at wake; it reports the note back, so a router
restarted during the sleep still knows the update. A fresh router (a restart) learns the version
from the replicas' reports until a driver first submits or updates: the highest any replica noted
or, with no note, holds is the latest update (a note is a replica's latest word, whatever its
number). No order is numbered at or below a version any replica reported, nor before a fresh
router heard its fleet (weights_floor.py). A replica holds the version when its
number and its source (the checkpoint's path, or "push://<id>") are the router's: a replica cut off
from a restarted router for longer than router.replica_timeout_s may hold the number that router
gave other weights since, and is ordered the router's.

A (path, version) whose load failed on a replica, or during whose loads DEATHS_TO_BREAK replicas
died, is broken: no replica is ordered it again, not the failed one's replacement (a load that broke or
killed an engine would do it to the next, in a loop of restarts), not a replica that joins
later, not one whose order was lost. Such a replica counts as
failed (`errors` names the break): the driver's update_weights raises, queued work fails once no
replica can run it, and the replicas that hold the version keep serving it. An update to a broken
path is refused. A replica that loads the version after the break (one ordered before it, or a
level-2 wake's reload) shows the failure was its replica's, not the checkpoint's: the break is
forgotten and the replicas held back get their order. (Replicas that held the version before the
break say nothing of it: a replacement may break where the first load worked.) The router keeps
the last BROKEN_KEPT breaks; a restarted router starts without them.

Plain state, no clock, no I/O: RouterCore passes the reports in and sends the orders out.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from ..protocol import InputError, LoadWeights, NoteWeights, StopPush, WeightsState, WeightsVersionError, is_int
from .state import ReplicaState
from .weights_floor import VersionFloor


BROKEN_KEPT = 64  # a long-lived router remembers this many breaks, the latest
DEATHS_TO_BREAK = 2  # replicas that died during one version's loads before it counts as broken


@dataclass(frozen=True)
class BrokenLoad:
    """A checkpoint whose load failed on a replica: not ordered again (until a replica loads it)."""

    path: str  # the checkpoint directory (resolved)
    version: int  # the version it was ordered as
    replica: str  # the replica whose load failed first
    error: str  # what that replica reported


class FleetWeights:
    def __init__(self):
        self.version = 0  # the version batches run on (0: the config's model)
        self.path: Optional[str] = None  # where it comes from (None: the config's model; "push://<id>": pushed)
        # A pushed version's tensors (push_weights): their buckets' object-store handles, sent with
        # every order of it, to joiners too. None for a checkpoint, and for a push a restarted router learned.
        # The trainer sends the first ones with the order and the rest as they are put (push_more).
        self.buckets: Optional[tuple] = None
        self.sent: dict[str, int] = {}  # replica_id -> how many of `buckets` its last order of the version named
        # A streamed push whose objects have not all come yet: how many it has in all (the manifest
        # and every bucket; None once all came, and for a checkpoint), and (version, path, buckets)
        # the fleet was at before it, where push_abort goes back to. Nothing more is kept: every
        # replica still holds the buckets of the version it has not replaced yet.
        self.total: Optional[int] = None
        self.previous: Optional[tuple] = None
        # the last push its trainer aborted (status): version, source, reason, the version gone back to,
        # and how each replica's load of it ended (its error: stopped, and whether it reloaded what it held)
        self.aborted: Optional[dict] = None
        self.aborted_reasons: dict[str, str] = {}  # the last BROKEN_KEPT aborted pushes' sources -> why (StopPush again)
        self.keep = False  # the version's loads swap under running sequences (update_weights running="keep")
        self.errors: dict[str, str] = {}  # replica_id -> why it cannot hold `version` (its load failed, or broke)
        self.broken: dict[tuple[str, int], BrokenLoad] = {}  # (path, version) -> its first failure, oldest first
        self.load_deaths: dict[tuple[str, int], list] = {}  # (path, version) -> replicas that died loading it
        self.held_back: set[str] = set()  # replicas not ordered the current version because it broke (in errors)
        # A fresh router learns the version from the replicas until a driver submits or updates.
        self.learning = True
        # No order is numbered at or below a version a replica reported, nor before a fresh
        # router heard its fleet (weights_floor.py).
        self.floor = VersionFloor()

    # ---- a driver's orders ---------------------------------------------------------------------
    def checked(self, path: str, version: Optional[int]) -> int:
        """The version an update to `path` would make (default: above the current one and every
        version a replica reported: the floor), or InputError."""
        if not isinstance(path, str) or not path.strip():
            raise InputError("path", path, "must be the path of a checkpoint directory")
        broke = next((b for (p, _), b in self.broken.items() if p == path), None)
        if broke is not None:
            raise InputError("path", path, f"its load as version {broke.version} failed on replica {broke.replica} "
                             f"({broke.error}); a broken checkpoint is not ordered again: write it under a new path")
        if path in self.aborted_reasons and path != self.path:  # (its push_abort came before its order)
            raise InputError("source", path, f"was aborted by its trainer ({self.aborted_reasons[path]}): push again")
        if version is None:
            version = self.floor.lowest_next(self.version)
        if not is_int(version) or version < self.floor.lowest_next(self.version):
            raise InputError("version", version, self.floor.why(self.version))
        return version

    def update(self, path: str, version: int, buckets: Optional[tuple] = None, keep: bool = False,
               total: Optional[int] = None) -> None:
        """Point the fleet at `path` as `version` (checked), pushed as `buckets` if given. The caller
        made sure that no load is under way, and no batch runs unless `running` said what becomes
        of it. `keep`: the load swaps under running sequences (LoadWeights.keep). `total`: a
        streamed push's objects in all, more than `buckets` (checked: total_checked)."""
        streaming = buckets is not None and total is not None and total > len(buckets)
        # where an abort goes back to: the last version whose objects all came (not a streamed
        # push still incomplete, whose trainer died without aborting it: no replica can hold it)
        came = self.previous if self.total is not None else (self.version, self.path, self.buckets)
        self.previous = came if streaming else None
        self.total = total if streaming else None
        self.version, self.path, self.learning, self.buckets = version, path, False, buckets
        self.keep = keep
        self.sent.clear()
        self.errors.clear()
        self.held_back.clear()
        self.load_deaths.clear()  # (they count toward the current version's break only)

    def extend(self, source, start, buckets: tuple) -> int:
        """The current push's next buckets (push_more), the objects from `start` on; returns how
        many it has now. InputError naming the field: another push than the current one (a newer
        version replaced it, or a restarted router lost its handles), or a gap or overlap."""
        if source in self.aborted_reasons and source != self.path:
            raise InputError("source", source, f"was aborted ({self.aborted_reasons[source]}); the fleet is at "
                             f"version {self.version}: push the weights again")
        if self.path is None or source != self.path or self.buckets is None:
            raise InputError("source", source, f"is not the push the fleet is at (its weights are version {self.version}, "
                             f"{self.path or 'the config model'!r}"
                             + (", learned without handles by a restarted router" if source == self.path else "")
                             + "): push the weights again")
        if not is_int(start) or start != len(self.buckets):
            raise InputError("start", start, f"must be {len(self.buckets)}, the number of the push's objects so far")
        if self.total is not None and start + len(buckets) > self.total:
            raise InputError("buckets", f"<{len(buckets)} objects from {start}>",
                             f"must end at or before the push's {self.total} objects (its order's `objects`)")
        self.buckets = self.buckets + tuple(buckets)
        if self.total is not None and len(self.buckets) >= self.total:
            self.total, self.previous = None, None  # every object came: the push can no longer be aborted
        return len(self.buckets)

    @staticmethod
    def total_checked(total, buckets: tuple) -> Optional[int]:
        """A push order's `objects` (how many it will have in all), or InputError naming it."""
        if total is not None and (not is_int(total) or total < len(buckets) or total > 1 << 20):
            raise InputError("objects", total, f"must be the push's objects in all (the manifest and every bucket): "
                             f"an integer from {len(buckets)}, the objects sent with the order, to {1 << 20}")
        return total

    def abort(self, source: str, reason: str) -> Optional[int]:
        """The trainer aborted the push `source` before all its objects came: the fleet goes back to
        the version it was at before (no replica could hold the push: none has all of it), and the
        next version is numbered above the aborted one, which names these weights for good. Returns
        the aborted version; None when `source` is not a push still coming (one whose objects all
        came, another, or one already aborted): nothing changes, but a push the router never took
        (its abort came first: the trainer's order went unanswered, and the two crossed) is
        remembered as aborted, and its order refused if it comes after."""
        if self.previous is None or source != self.path:
            held = {self.path, self.previous[1] if self.previous else None}
            if isinstance(source, str) and source not in held:  # (push_abort's source: checked_abort)
                self._remember_aborted(source, reason)
            return None
        aborted = self.version
        self.floor.passed(aborted, f"push {source} was aborted as version {aborted}")
        self.version, self.path, self.buckets = self.previous
        self.previous, self.total, self.keep = None, None, False
        self.aborted = {"version": aborted, "source": source, "reason": reason, "back_to": self.version,
                        "replicas": {}}
        self._remember_aborted(source, reason)
        self.sent.clear()
        self.errors.clear()
        self.held_back.clear()
        self.load_deaths.clear()
        return aborted

    def _remember_aborted(self, source: str, reason: str) -> None:
        self.aborted_reasons[source] = reason
        while len(self.aborted_reasons) > BROKEN_KEPT:
            self.aborted_reasons.pop(next(iter(self.aborted_reasons)))

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
        """A restarted router, with no batch running: take the highest version a replica noted
        while asleep or, with no note, holds (a batch that ran before the restart is lost with the router, and none
        runs now: no batch mixes versions)."""
        if not self.learning and self.path is not None:
            return
        # A note is newer than the weights held (a load as high clears it): a note numbered below
        # them is a later router's, which the replica loads at wake, not the weights it holds.
        version, path = (w.noted, w.noted_path) if w.noted and w.noted_path else (w.version, w.path)
        if version > self.version and path:
            self.version, self.path, self.buckets = version, path, None
            self.errors.clear()  # they were for an older version
            self.held_back.clear()

    def record(self, rep: ReplicaState, w: WeightsState, load_pending: bool, note_pending: bool) -> bool:
        """What the replica reports holding. `load_pending`/`note_pending`: an order of that kind
        waits in its outbox. Returns whether it just became unable to hold the current version: its
        load failed, or the version broke another replica's load and it is held back."""
        v = self.version
        self.floor.saw(rep.replica_id, w)
        if self.aborted is not None and w.error and w.error_path == self.aborted["source"]:
            self.aborted["replicas"][rep.replica_id] = w.error
        held_before = self.holds(rep)
        # a load of the current version by this replica, ordered (or noted) by this router, or under way:
        # only such a load shows a break was another replica's (a replica that held the version before
        # the break, registered again after a silence, loaded nothing)
        loaded_here = rep.weights_ordered == v or rep.weights_noted == v or self.loads_current(rep)
        # (a report that names no source for the number it held, a goodbye's, keeps the known one)
        same = w.version == rep.weights_version
        rep.weights_path = w.path if isinstance(w.path, str) and w.path else rep.weights_path if same else ""
        rep.weights_version, rep.weights_loading = w.version, w.loading
        rep.weights_loading_path = w.loading_path if w.loading and isinstance(w.loading_path, str) else ""
        handed = w.handed_counts()  # (a goodbye's, none counted, keeps the known one as the path does)
        rep.weights_handed = handed if handed else rep.weights_handed if same else {}
        just_loaded = not held_before and self.holds(rep) and loaded_here
        if (rep.weights_noted == v and not self.current(w.noted, w.noted_path) and not self.holds(rep)
                and not note_pending):
            rep.weights_noted = None  # the note was sent and the replica never saw it: again
        if self.holds(rep):
            self.errors.pop(rep.replica_id, None)
            if just_loaded:
                self._loaded()
        elif w.error and self.current(w.error_version, w.error_path):  # (not another source's same number)
            if rep.replica_id not in self.errors or rep.replica_id in self.held_back:
                self.held_back.discard(rep.replica_id)
                self.errors[rep.replica_id] = w.error
                self._broke(rep.replica_id, w.error)
                return True
        elif rep.weights_ordered == v and not self.current(w.loading, w.loading_path) and not load_pending:
            rep.weights_ordered = None  # the order was sent and the replica never saw it: again
        self._lost_objects(rep, w, load_pending or note_pending)
        if self.holds_back(rep) and rep.replica_id not in self.errors:
            b = self.broken[(self.path, v)]
            self.held_back.add(rep.replica_id)
            self.errors[rep.replica_id] = (f"replica {rep.replica_id}: not ordered {self.path!r} (version {v}): "
                                           f"its load failed on replica {b.replica}: {b.error}")
            return True
        return False

    def _lost_objects(self, rep: ReplicaState, w: WeightsState, pending: bool) -> None:
        """A streamed push: the replica loads (or noted) it knowing fewer of its objects than its
        last order named, and no order to it waits. That order (push_more's) was lost with its pull's
        reply: counted as sent only as far as the replica knows, so that order_for sends it again
        naming them all (else the load would wait for them, then fail when the stream stalls)."""
        rid, known = rep.replica_id, w.objects
        on_it = self.current(w.loading, w.loading_path) if w.loading else self.current(w.noted, w.noted_path)
        if (self.buckets is not None and is_int(known) and 0 < known < self.sent.get(rid, 0) and on_it
                and not pending):
            self.sent[rid] = known

    def still_on_aborted(self, w: WeightsState) -> Optional[StopPush]:
        """A StopPush for the aborted push the replica reports it loads, or noted while asleep, with
        no StopPush of it taken (WeightsState.stopped): the first one was lost with a pull's reply.
        None: nothing to stop."""
        for path, on in ((w.loading_path, w.loading), (w.noted_path, w.noted)):
            if on and isinstance(path, str) and path in self.aborted_reasons and w.stopped != path:
                return StopPush(path, self.aborted_reasons[path])
        return None

    def holds_back(self, rep: ReplicaState) -> bool:
        """It lacks the current version, which broke a load, and was not ordered it before the break."""
        v = self.version
        return ((self.path, v) in self.broken and not self.holds(rep) and rep.weights_ordered != v
                and not self.loads_current(rep) and rep.weights_noted != v)

    def died_loading(self, rep: ReplicaState) -> None:
        """`rep` died (its engine, or its process) with the current version ordered or loading and
        not held. An engine that a load kills says no error, and its replacement, ordered the same
        load, would die the same way, in a loop of restarts; but a replica also dies of other causes,
        and its replacement must get the version. So the DEATHS_TO_BREAK-th death during one
        version's loads is a break, as a failed load is; a replica that loads the version shows the
        deaths were their own (`_loaded` forgets the break). Only a death in a load of the current
        version counts (or with its order delivered and no load reported yet: not one whose order
        still waited in the outbox, which never reached an engine): not one in a load of another
        source's same number (a replica cut off from this restarted router, loading its predecessor's)."""
        v = self.version
        ordered = rep.weights_ordered == v and rep.weights_order_sent == v  # (an order still in the outbox reached none)
        if self.holds(rep) or not (self.loads_current(rep) if rep.weights_loading else ordered):
            return
        died = self.load_deaths.setdefault((self.path, v), [])
        died.append(rep.replica_id)
        if len(died) >= DEATHS_TO_BREAK:
            self._broke(rep.replica_id, f"replicas {', '.join(died)} died while loading version {v} (a load that "
                                        "kills engines is not ordered again)")

    def _broke(self, replica_id: str, error: str) -> None:
        key = (self.path, self.version)
        if self.path is not None and key not in self.broken:
            self.broken[key] = BrokenLoad(self.path, self.version, replica_id, error)
            while len(self.broken) > BROKEN_KEPT:
                self.broken.pop(next(iter(self.broken)))

    def _loaded(self) -> None:
        """A replica just loaded the current version: if it broke a load before, it loads after all
        (the failure was that replica's), and the replicas held back get their order."""
        self.load_deaths.pop((self.path, self.version), None)
        if self.broken.pop((self.path, self.version), None) is not None:
            for rid in self.held_back:
                self.errors.pop(rid, None)
            self.held_back.clear()

    def order_for(self, rep: ReplicaState, awake: bool) -> Optional[LoadWeights | NoteWeights]:
        """The order `rep` needs now, once: a load if it does not hold the version, or a note of it
        while its engine sleeps (or moves to or from sleep). None: nothing to send."""
        v = self.version
        if self.path is None or self.holds(rep) or self.holds_back(rep):
            return None
        # A push whose later buckets came after this replica's order: the order again, naming them
        # (the replica adds them to the load or note under way; a failed one is not ordered again).
        more = (self.buckets is not None and self.sent.get(rep.replica_id, 0) < len(self.buckets)
                and rep.replica_id not in self.errors)
        if rep.weights_ordered == v and not more:
            return None
        if not awake and rep.weights_ordered != v:
            if rep.weights_noted == v and not more:
                return None
            rep.weights_noted = v
            self.sent[rep.replica_id] = len(self.buckets or ())
            return NoteWeights(self.path, v, self.buckets)
        rep.weights_ordered = v
        self.sent[rep.replica_id] = len(self.buckets or ())
        return LoadWeights(self.path, v, self.buckets, keep=self.keep)

    def forget(self, replica_id: str) -> None:
        self.errors.pop(replica_id, None)
        self.sent.pop(replica_id, None)
        self.held_back.discard(replica_id)

    # ---- what the fleet can do -----------------------------------------------------------------
    def current(self, version: int, path) -> bool:
        """`version` from `path` is the current version: the same number from the same source. (A
        report that names no source, a goodbye's, is taken by its number.)"""
        return version == self.version and (not path or not self.path or path == self.path)

    def loads_current(self, rep: ReplicaState) -> bool:
        """It reports loading the current version (a report that names no source: by its number)."""
        return self.current(rep.weights_loading, rep.weights_loading_path)

    def holds(self, rep: ReplicaState) -> bool:
        """It holds the current version (loading another or not)."""
        return self.current(rep.weights_version, rep.weights_path)

    def held_by(self, rep: ReplicaState) -> bool:
        """It holds the current version and loads no other."""
        return self.holds(rep) and not rep.weights_loading

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
                      if r.weights_ordered == v and not self.holds(r) and rid not in self.errors)

    def status(self, replicas: dict) -> dict:
        return {"version": self.version, "path": self.path,
                "replicas": {rid: r.weights_version for rid, r in replicas.items()},
                # those that hold the current weights, number and source (a replica cut off from a
                # restarted router may hold the same number of other weights: not these)
                "held": sorted(rid for rid, r in replicas.items() if self.holds(r)),
                # how each replica's engine had the buckets of its weights' load handed to vLLM's worker
                "handed": {rid: dict(r.weights_handed) for rid, r in replicas.items()},
                "errors": dict(self.errors), "broken": [asdict(b) for b in self.broken.values()],
                # a streamed push whose objects still come (the order's count), and the last push aborted
                "streaming": self.total is not None,
                "aborted": {**self.aborted, "replicas": dict(self.aborted["replicas"])} if self.aborted else None}
