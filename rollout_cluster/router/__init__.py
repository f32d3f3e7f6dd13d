"""The router: the single owner of sequence state (core.py) and the components it holds.

Import what you need from its modules (`from rollout_cluster.router.core import RouterCore`):
this file imports nothing, so that the pure policies can read `router.state` without the core.
"""
