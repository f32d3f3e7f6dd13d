"""A batch of RolloutClient's, followed to its end: `run_requests` blocks until every completion is
in (loops.run_sync), `stream` yields them as they finish (loops.follow_batch), both over the
sans-I/O BatchFollower (follower.py). RolloutClient's methods carry the docstrings; these
functions take the client, whose router restarts they count and whose last batch they note.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Optional, Sequence, Union

from ..protocol import Completion, SamplingSpec
from .expand import expand
from .follower import ROUTER_SUBMIT_WAIT_S, BatchFollower
from .loops import follow_batch, run_sync


def run_requests(client, requests: list, progress: bool, timeout_s: Optional[float],
                 wait_for_replica_s: Optional[float], weights_version: Optional[int],
                 finish_fraction: Optional[float], finish_by: str) -> list:
    follower = BatchFollower(requests, client.timeout_s if timeout_s is None else timeout_s, client.call_timeout_s,
                             client.max_router_restarts, weights_version, finish_fraction, finish_by,
                             wait_for_replica_s, router_wait_s(client))
    bar = _bar(len(requests), progress)
    try:
        return run_sync(client.router, follower, client.call_timeout_s, on_submitted=client._note_batch,
                        on_restart=client._count_restart, on_placed=_counter(bar))
    finally:
        if bar:
            bar.close()


async def stream(client, prompts: Sequence, sampling: Union[SamplingSpec, Sequence[SamplingSpec], None],
                 timeout_s: Optional[float], weights_version: Optional[int], finish_fraction: Optional[float],
                 finish_by: str, sessions: Optional[Sequence]) -> AsyncIterator[Completion]:
    if sampling is None:
        status = await asyncio.wait_for(client.router.status.remote(), client.call_timeout_s)
        sampling = SamplingSpec(**status.get("sampling_defaults", {}))
    async for c in follow_batch(client.router, expand(prompts, sampling, sessions=sessions),
                                client.timeout_s if timeout_s is None else timeout_s, client.call_timeout_s,
                                client.max_router_restarts, weights_version,
                                on_restart=client._count_restart, finish_fraction=finish_fraction,
                                finish_by=finish_by, router_wait_s=router_wait_s(client)):
        yield c


def router_wait_s(client) -> float:
    """How long the client's router waits for a live replica at a submit that names no wait: its
    config's router.submit_wait_for_replica_s (the default without a config)."""
    config = getattr(client, "config", None)
    return config.router.submit_wait_for_replica_s if config is not None else ROUTER_SUBMIT_WAIT_S


def _bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="sequences", unit="seq")


def _counter(bar):
    return None if bar is None else (lambda placed: bar.update(len(placed)))
