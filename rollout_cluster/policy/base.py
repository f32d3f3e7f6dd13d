"""The policy contract: one required method, `decide`.

The router calls `decide(view, replica_id)` each time a replica pulls, after applying that
replica's report. The policy returns what to do; the router does it:
- `assign`: start these queued sequences, each on the named replica (usually the one pulling;
  push-style baselines may name another, whose outbox holds the work until it pulls);
- `give_up`: stop these running sequences at their replica; their partial output comes back
  in that replica's next report and the sequence continues on `destination` (or any replica).
A policy may keep its own bookkeeping but must not mutate the view. Time is `view.now`.
Failure modes: naming a sequence that is not queued (assign) or not running (give_up) is a
bug in the policy; the router drops such entries and counts them.

Each policy's settings are a `PolicySettings` model in its own module, named by `name` (the
config's `policy:` mapping); policy/registry.py ties the name to the model and the policy.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional

from ..router.state import ClusterView, SeqState
from ..strict_model import StrictModel


@dataclass
class Assign:
    seq: SeqState
    replica_id: str
    segment_cap: Optional[int] = None  # stop this segment after this many tokens (chunked)


@dataclass
class GiveUp:
    seq: SeqState
    destination: Optional[str] = None


@dataclass
class Decision:
    assign: list = field(default_factory=list)
    give_up: list = field(default_factory=list)


class PolicySettings(StrictModel):
    """A policy's settings: the keys under `policy:` when `policy.name` names it. Strict like
    the rest of the config (strict_model.py: strict types, finite floats, 64-bit integers)."""

    name: str


class Policy(ABC):
    name = "base"

    @abstractmethod
    def decide(self, view: ClusterView, replica_id: str) -> Decision:
        """What to start and what to give up, now that `replica_id` has pulled."""

    def on_replica_removed(self, replica_id: str) -> None:
        """A replica died or left."""
