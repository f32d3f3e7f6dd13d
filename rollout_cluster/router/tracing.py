"""What the router records about its own running while a driver traces it (set_trace), and the
bounded windows its statistics keep.

A long-lived router serves batch after batch: every record here is a recent window, trimmed in
bulk, never a history that grows with the router's age. Plain state: no clock, no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..protocol import EngineStats

STEP_SAMPLES_KEPT = 100_000


def append_bounded(values: list, value, keep: int) -> None:
    """Append, keeping at least the last `keep` values (and at most 2 * keep)."""
    values.append(value)
    if len(values) > 2 * keep:  # trim in bulk: amortised O(1) per append
        del values[:-keep]


@dataclass
class RouterTrace:
    pulls: Optional[list] = None  # (time, replica_id, sequences held) per pull, after its decision; None: not tracing
    # While tracing: (running, context tokens, s per token per sequence) per report, for fitting a
    # cost profile to the engines as they run here (calibrate --from-samples).
    step_samples: list = field(default_factory=list)

    def pull(self, now: float, replica_id: str, held: int) -> None:
        if self.pulls is not None:
            self.pulls.append((now, replica_id, held))

    def step(self, stats: EngineStats) -> None:
        """A report's engine stats, kept while tracing if they measured a step (idle ones did not)."""
        if self.pulls is not None and stats.seq_tokens_per_s > 0 and stats.running > 0:
            append_bounded(self.step_samples, (stats.running, stats.context_tokens, 1.0 / stats.seq_tokens_per_s),
                           STEP_SAMPLES_KEPT)
