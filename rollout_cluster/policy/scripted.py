"""`scripted`: pull dispatch, plus a forced migration of every running sequence each time its
generated tokens reach the next threshold of `at_tokens`. It exists to prove exactness
(a migrated sequence equals an unmigrated one) and to exercise the give-up path on demand."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..router.state import ClusterView, SeqStatus
from .base import Decision, GiveUp, PolicySettings
from .pull import PullPolicy


class ScriptedConfig(PolicySettings):
    name: Literal["scripted"] = "scripted"
    scripted_at_tokens: list[int] = Field(default_factory=list, description="migrate at these token counts")


class ScriptedPolicy(PullPolicy):
    name = "scripted"

    def __init__(self, at_tokens: list):
        self.at_tokens = sorted(int(t) for t in at_tokens)

    def decide(self, view: ClusterView, replica_id: str) -> Decision:
        decision = super().decide(view, replica_id)
        others = sorted(r for r in view.replicas if r != replica_id)
        if not others:
            return decision
        for seq in view.replicas[replica_id].seqs.values():
            if (seq.status is SeqStatus.RUNNING and seq.moves < len(self.at_tokens)
                    and seq.generated >= self.at_tokens[seq.moves] and seq.migratable):
                decision.give_up.append(GiveUp(seq, destination=others[(seq.index + seq.moves) % len(others)]))
        return decision
