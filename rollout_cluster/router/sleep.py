"""The fleet's sleep state: vLLM sleep mode between RL steps, so a trainer on the same GPUs gets
their memory back.

The driver's sleep(level) sets the level the whole fleet should be at (1: vLLM offloads the
weights to host memory and drops the KV cache; 2: it drops the weights too, and waking reloads
them from the latest checkpoint); wake() sets it back to 0. Every replica gets one order for the
level, and one that joins later gets it when it registers. A replica reports the level its
engine is at and the one it was last told to reach (`Report.sleep_level`, `sleep_goal`): the
router sends the order again only when a lost reply took it (the goal is not the fleet's and no
order is waiting in the outbox). A replica gets work only while it and the fleet are awake.

Plain bookkeeping, no clock and no I/O: RouterCore drives it and sends the orders it makes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..protocol import InputError, Sleep, Wake, is_int

SLEEP_LEVELS = (1, 2)


@dataclass
class FleetSleep:
    level: int = 0  # the fleet's target: 0 awake, else a vLLM sleep level
    at: dict = field(default_factory=dict)  # replica_id -> (level its engine is at, its goal)
    errors: dict = field(default_factory=dict)  # replica_id -> why reaching `level` failed there
    ordered: bool = False  # a driver set the level (a fresh router has not)

    @staticmethod
    def check_level(level) -> None:
        if not is_int(level) or level not in SLEEP_LEVELS:
            raise InputError("level", level, "must be 1 (offload the weights to host memory, drop the KV cache) "
                             "or 2 (drop both; waking reloads the latest checkpoint)")

    def order(self, weights_path: Optional[str], weights_version: int, buckets=None) -> Sleep | Wake:
        """The order that takes a replica to the fleet's level: a level-2 sleeper reloads the
        fleet's current weights (pushed: from `buckets`) when it wakes."""
        return Sleep(self.level) if self.level else Wake(weights_path, weights_version, buckets)

    def refusal(self, replica_ids) -> Optional[str]:
        """Why a batch cannot run now (None: it can): the fleet sleeps, or no live engine woke."""
        if self.level:
            return (f"the engines are asleep (level {self.level}, RolloutClient.sleep): call wake() before "
                    "submitting a batch")
        if self.errors and all(rid in self.errors for rid in replica_ids):
            return "no engine woke: " + "; ".join(sorted(self.errors.values())) + " (wake() again tries once more)"
        return None

    def set(self, level: int) -> None:
        self.level = level
        self.ordered = True
        self.errors.clear()

    def record(self, replica_id: str, level: int, goal: int, error: Optional[str]) -> None:
        if not self.ordered and goal > self.level:
            # A restarted router: the replicas sleep because a driver said so, and a trainer may
            # be using their memory. Keep them asleep (at the deepest level one reports: a level-2
            # sleeper told level 1 would wake without reloading) until a driver says wake.
            self.level = goal
        self.at[replica_id] = (level, goal)
        if level == self.level:
            self.errors.pop(replica_id, None)
        elif error and goal == self.level:
            self.errors[replica_id] = error

    def settle(self) -> None:
        """A driver submitted a batch: the fleet is awake from now on, whatever a late sleeper
        reports (a restarted router learns a level only before that)."""
        self.ordered = True

    def needs_order(self, replica_id: str) -> bool:
        """The replica was not told the fleet's level (it joined, or the reply was lost)."""
        return self.at.get(replica_id, (0, 0))[1] != self.level

    def awake(self, replica_id: str) -> bool:
        """Work may go to it: the fleet and its engine are awake, and it is not moving."""
        return self.level == 0 and self.at.get(replica_id, (0, 0)) == (0, 0)

    def forget(self, replica_id: str) -> None:
        self.at.pop(replica_id, None)
        self.errors.pop(replica_id, None)

    def status(self) -> dict:
        return {"level": self.level, "replicas": {rid: lv for rid, (lv, _) in self.at.items()},
                "moving": sorted(rid for rid, (lv, goal) in self.at.items() if lv != goal and rid not in self.errors),
                "errors": dict(self.errors)}
