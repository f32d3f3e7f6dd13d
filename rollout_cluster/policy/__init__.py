"""Scheduling policies: pure functions of a ClusterView (no ray, vllm, asyncio or clock).
Each has a settings model beside it; registry.py lists them by name."""
from .base import Assign, Decision, GiveUp, Policy, PolicySettings
from .factory import make_policy

__all__ = ["Assign", "Decision", "GiveUp", "Policy", "PolicySettings", "make_policy"]
