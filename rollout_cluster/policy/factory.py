"""Policies by name, as the config's `policy.name` selects them (policy/registry.py)."""
from __future__ import annotations

from ..engines.cost_model import CostModel
from .base import Policy, PolicySettings
from .registry import REGISTRY


def make_policy(cfg: PolicySettings, cost: CostModel | None = None) -> Policy:
    """A fresh policy from its settings (`cfg.policy`); `cost` is the cost model steal predicts with."""
    entry = REGISTRY.get(cfg.name)
    if entry is None or not isinstance(cfg, entry.settings):
        raise ValueError(f"policy.name={cfg.name!r}: unknown policy, or settings of another type "
                         f"(known: {', '.join(REGISTRY)})")
    return entry.build(cfg, cost)
