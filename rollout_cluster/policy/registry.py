"""Every policy by name: its settings model (the keys under the config's `policy:` when
`policy.name` is that name), how to build it, and whether the bench runs it by default.

The config's `policy` union, its known names, `make_policy` and the bench's policy list all read
REGISTRY: a new policy is one module (its Policy and its settings model) and one line here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from ..engines.cost_model import CostModel, load_profile
from .base import Policy, PolicySettings
from .chunked import ChunkedConfig, ChunkedPolicy
from .least_loaded import LeastLoadedConfig, LeastLoadedPolicy
from .pull import PullConfig, PullPolicy
from .scripted import ScriptedConfig, ScriptedPolicy
from .static import StaticConfig, StaticPolicy
from .steal import StealConfig, StealPolicy

DEFAULT_POLICY = "steal"  # a `policy:` mapping without a name
DEFAULT_PROFILE = "a100-80g-7b"  # steal's cost model when the caller gives none


@dataclass(frozen=True)
class PolicyEntry:
    settings: type  # a PolicySettings subclass; its `name` default is the policy's name
    build: Callable[[PolicySettings, Optional[CostModel]], Policy]  # a fresh policy from its settings
    benchable: bool = True  # `rollout-cluster bench` runs it by default (scripted only tests migrations)

    @property
    def name(self) -> str:
        return self.settings.model_fields["name"].default


# In the bench's order: the baselines, then ours.
REGISTRY = {e.name: e for e in (
    PolicyEntry(StaticConfig, lambda s, cost: StaticPolicy()),
    PolicyEntry(ChunkedConfig, lambda s, cost: ChunkedPolicy(s.chunk_tokens)),
    PolicyEntry(LeastLoadedConfig, lambda s, cost: LeastLoadedPolicy()),
    PolicyEntry(PullConfig, lambda s, cost: PullPolicy()),
    PolicyEntry(StealConfig, lambda s, cost: StealPolicy(s, cost or load_profile(DEFAULT_PROFILE))),
    PolicyEntry(ScriptedConfig, lambda s, cost: ScriptedPolicy(s.scripted_at_tokens), benchable=False),
)}
POLICY_NAMES = tuple(REGISTRY)
BENCH_POLICIES = tuple(name for name, e in REGISTRY.items() if e.benchable)


def owners_of(key: str) -> list:
    """The policies that have a setting `key`."""
    return [name for name, e in REGISTRY.items() if key in e.settings.model_fields]
