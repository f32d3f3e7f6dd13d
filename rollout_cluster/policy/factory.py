"""Policies by name, as the config's `policy.name` selects them."""
from __future__ import annotations

from ..config import PolicyConfig
from ..engines.cost_model import CostModel, load_profile
from .base import Policy
from .chunked import ChunkedPolicy
from .least_loaded import LeastLoadedPolicy
from .pull import PullPolicy
from .scripted import ScriptedPolicy
from .static import StaticPolicy
from .steal import StealPolicy


def make_policy(cfg: PolicyConfig, cost: CostModel | None = None) -> Policy:
    name = cfg.name
    if name == "steal":
        return StealPolicy(cfg, cost or load_profile("a100-80g-7b"))
    if name == "pull":
        return PullPolicy()
    if name == "static":
        return StaticPolicy()
    if name == "least-loaded":
        return LeastLoadedPolicy()
    if name == "chunked":
        return ChunkedPolicy(cfg.chunk_tokens)
    if name == "scripted":
        return ScriptedPolicy(cfg.scripted_at_tokens)
    raise ValueError(f"policy.name={name!r}: unknown policy")
