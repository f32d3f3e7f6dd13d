"""Scheduling policies: pure functions of a ClusterView (no ray, vllm, asyncio or clock)."""
from .base import Assign, Decision, GiveUp, Policy
from .factory import make_policy

__all__ = ["Assign", "Decision", "GiveUp", "Policy", "make_policy"]
