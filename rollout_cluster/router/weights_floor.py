"""VersionFloor: no weights order is numbered at or below a version the fleet already knows.

A weights version names one set of weights for good: a driver pins batches to it
(`submit(weights_version=v)`) and every Completion's `weight_versions` carries it. The router
numbers an order (update_weights, push_weights) as its current version + 1; but a router that
restarted starts at version 0 and learns the fleet's from the replicas' reports, so an order it
numbered before hearing them would reuse a number the fleet holds, loads or noted for other
weights (and a replica takes a LoadWeights of the version it loads for a resent order: it
would never load the new weights).

Two rules close that:
- the floor: the highest version any replica ever reported holding, loading, noting while
  asleep, or failing to load. An order is numbered above it, and an explicit version at or
  below it is refused naming both;
- hearing the fleet: a fresh router numbers no order until it has heard every replica it
  expects (Fleet.expected), or until router.replica_timeout_s passed since it started (a replica
  silent that long is dead, and its replacement starts on the config's model). Until then a
  weights order is refused with WeightsNotLearned, a retryable error: nothing changed. Once
  heard, it stays heard: a replica that dies later does not hold weights orders up.
A replica silent past that timeout may still come back (cut off, not dead) holding a number
numbered again since: FleetWeights.holds compares the version's source too, so it is ordered the
router's weights rather than taken for current.

Plain state, no clock (time is an argument), no I/O.
"""
from __future__ import annotations

from typing import Optional

from ..protocol import WeightsState, WeightsNotLearned


class VersionFloor:
    """The floor under the next weights version, and whether a fresh router may number one yet.
    Held by FleetWeights; RouterCore passes the clock in (`began`), control.py asks `check_heard`."""

    def __init__(self):
        self.highest = 0  # the highest version a replica reported (held, loading, noted or failed); 0: none
        self.highest_how = ""  # who reported it and how ("replica b loads it"), for refusals
        self.started_t: Optional[float] = None  # the first time this router saw (its start, near enough)
        self.heard = False  # every expected replica reported since the start, or a replica timeout passed
        self.reporters: set[str] = set()  # replicas that reported since the start, until `heard` (dead ones too)

    def began(self, now: float) -> None:
        """The router's clock at a report or a periodic check: the first one is its start."""
        if self.started_t is None:
            self.started_t = now

    def saw(self, replica_id: str, w: WeightsState) -> None:
        """A replica's report of its weights: raise the floor to any version it names."""
        if not self.heard:
            self.reporters.add(replica_id)
        for version, how in ((w.version, "holds"), (w.loading, "loads"), (w.noted, "noted while asleep"),
                             (w.error_version if w.error else 0, "failed to load")):
            if isinstance(version, int) and version > self.highest:
                self.highest, self.highest_how = version, f"replica {replica_id} {how} it"

    def check_heard(self, what: str, expected: int, now: Optional[float], timeout_s: float) -> None:
        """Refuse (WeightsNotLearned) a weights order while this router may not have heard a
        version the fleet holds: fewer than `expected` replicas reported since it started (one
        that died since counts: its version was heard), and less than `timeout_s` passed since
        then. `now` None: only the count says (no clock)."""
        if self.hear(expected, now, timeout_s):
            return
        heard = len(self.reporters)
        waited = f" {now - self.started_t:.0f} s ago" if now is not None else ""
        raise WeightsNotLearned(
            f"{what}: this router is new (or restarted{waited}) and has heard the weights of {heard} of the "
            f"{expected} replica(s) it expects; it numbers a weights version only above every version the fleet "
            f"holds or loads (the highest reported so far: {self.highest}), so it waits for the rest, at most "
            f"router.replica_timeout_s = {timeout_s:g} s after it started (a replica silent that long is dead). "
            "Nothing was changed: retry in a moment (RolloutClient does, within its timeout)")

    def hear(self, expected: int, now: Optional[float], timeout_s: float) -> bool:
        """Whether this router has heard the fleet: `expected` replicas reported since it started,
        or `timeout_s` passed since then (check_heard's rule, without the refusal)."""
        if self.heard:
            return True
        if now is not None:
            self.began(now)
        heard = len(self.reporters)
        if (heard and heard >= expected) or (now is not None and now - self.started_t >= timeout_s):
            self.heard, self.reporters = True, set()
        return self.heard

    def passed(self, version: int, how: str) -> None:
        """`version` named weights the fleet went back from (an aborted push): never numbered again."""
        if version > self.highest:
            self.highest, self.highest_how = version, how

    def lowest_next(self, current: int) -> int:
        """The lowest version a new order may take: above the current one and the floor."""
        return max(current, self.highest) + 1

    def why(self, current: int) -> str:
        """What a version must be above, naming both values when the floor is the higher."""
        if self.highest > current:
            return (f"must be an integer above {self.highest}, the highest version the fleet knows "
                    f"({self.highest_how}; this router's current version is {current})")
        return f"must be an integer above the current version {current}"
