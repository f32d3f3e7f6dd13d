"""The config's `limits` as the router applies them to a batch, before anything is registered."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..protocol import LimitExceeded, RouterBusy


@dataclass(frozen=True)
class BatchLimits:
    max_n: Optional[int] = None  # samples per prompt (a SamplingSpec's n); None: unbounded
    max_batch_sequences: Optional[int] = None  # sequences in one batch
    max_live_sequences: Optional[int] = None  # unfinished sequences of every batch together

    @classmethod
    def of(cls, limits) -> "BatchLimits":
        """From a LimitsConfig."""
        return cls(limits.max_n, limits.max_batch_sequences, limits.max_live_sequences)

    def check_batch(self, size: int, live: int) -> None:
        """LimitExceeded if a batch of `size` sequences cannot be taken while `live` are held."""
        if self.max_batch_sequences is not None and size > self.max_batch_sequences:
            raise LimitExceeded("limits.max_batch_sequences",
                                f"a batch of {size} sequences: at most limits.max_batch_sequences="
                                f"{self.max_batch_sequences} (split it)")
        if self.max_live_sequences is not None and live + size > self.max_live_sequences:
            raise RouterBusy("limits.max_live_sequences",
                                f"the router holds {live} live sequences; {size} more would pass "
                                f"limits.max_live_sequences={self.max_live_sequences}: retry when batches finish")

    def n_error(self, n) -> Optional[str]:
        """Why a request with `n` samples per prompt is refused, or None."""
        if self.max_n is not None and isinstance(n, int) and n > self.max_n:
            return f"n={n}: at most limits.max_n={self.max_n} samples per prompt"
        return None
