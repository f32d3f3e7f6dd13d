"""`chunked`: generation in rounds of at most `chunk_tokens` tokens. A round starts only when
nothing runs anywhere; then every queued sequence (fresh or unfinished) is split evenly and
contiguously across the live replicas. An unfinished sequence continues next round with
prompt + partial as its prompt, exactly like a migration (and paying the same re-prefill)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Assign, Decision, Policy, PolicySettings
from .static import split_contiguous
from ..router.state import ClusterView


class ChunkedConfig(PolicySettings):
    name: Literal["chunked"] = "chunked"
    chunk_tokens: int = Field(1024, ge=1, description="tokens per round")


class ChunkedPolicy(Policy):
    name = "chunked"

    def __init__(self, chunk_tokens: int = 1024):
        self.chunk_tokens = chunk_tokens
        self.rounds = 0

    def decide(self, view: ClusterView, replica_id: str) -> Decision:
        if view.running or not len(view.queue):
            return Decision()
        if len(view.replicas) < view.expected_replicas and self.rounds == 0:
            return Decision()  # the first round waits for the whole fleet, like SPMD
        queued = sorted(list(view.queue.unreserved()) + [s for l in view.queue.reserved.values() for s in l.values()],
                        key=lambda s: s.index)
        self.rounds += 1
        out = []
        for rid, share in zip(sorted(view.replicas), split_contiguous(queued, len(view.replicas))):
            # a pinned sequence (its penalties count its own output) runs whole: a later round's
            # continuation would take its output for prompt
            out += [Assign(s, rid, segment_cap=self.chunk_tokens if s.migratable else None) for s in share]
        return Decision(assign=out)
