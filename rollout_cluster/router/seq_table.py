"""The sequences on one replica: a mapping by seq_id for the router, numpy columns for the policy.

The steal policy reads every sequence's progress, context and cap at each decision. The columns
are kept up to date as the router changes the state, at O(1) a change: a sequence joins
(dispatch), leaves (finish, give-up, loss), reports tokens, or is told to give up. A decision
then reads arrays instead of walking SeqState objects. Row order is not insertion order: a
leaving sequence's row is filled by the last one.
"""
from __future__ import annotations

import numpy as np

_MIN_ROWS = 64


class SeqTable:
    """seq_id -> SeqState for the sequences one replica holds (running or giving up), with the
    columns `generated`, `prompt_len`, `max_tokens` and `running` (not giving up), row i
    describing `rows[i]`."""

    __slots__ = ("_row", "rows", "generated", "prompt_len", "max_tokens", "running")

    def __init__(self):
        self._row: dict = {}
        self.rows: list = []
        self.generated = np.zeros(_MIN_ROWS)
        self.prompt_len = np.zeros(_MIN_ROWS)
        self.max_tokens = np.zeros(_MIN_ROWS)
        self.running = np.zeros(_MIN_ROWS, dtype=bool)

    # --- the mapping the router and the baselines read ---------------------------------------
    def __len__(self) -> int:
        return len(self.rows)

    def __bool__(self) -> bool:
        return bool(self.rows)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._row

    def __iter__(self):
        return iter([s.seq_id for s in self.rows])

    def __getitem__(self, seq_id):
        return self.rows[self._row[seq_id]]

    def get(self, seq_id, default=None):
        i = self._row.get(seq_id)
        return default if i is None else self.rows[i]

    def values(self) -> list:
        """A copy: the router removes sequences while walking them."""
        return list(self.rows)

    def keys(self) -> list:
        return [s.seq_id for s in self.rows]

    # --- changes (the router's) --------------------------------------------------------------
    def __setitem__(self, seq_id, seq) -> None:
        if seq_id in self._row:
            del self[seq_id]
        i = len(self.rows)
        if i == len(self.generated):
            self._grow()
        self._row[seq_id] = i
        self.rows.append(seq)
        self.generated[i] = seq.generated
        self.prompt_len[i] = seq.request.prompt_len
        self.max_tokens[i] = seq.request.sampling.max_tokens
        self.running[i] = True  # a sequence joins at dispatch

    def __delitem__(self, seq_id) -> None:
        i = self._row.pop(seq_id)
        last = len(self.rows) - 1
        if i != last:
            moved = self.rows[last]
            self.rows[i] = moved
            self._row[moved.seq_id] = i
            for col in (self.generated, self.prompt_len, self.max_tokens, self.running):
                col[i] = col[last]
        self.rows.pop()

    def pop(self, seq_id, default=None):
        seq = self.get(seq_id)
        if seq is None:
            return default
        del self[seq_id]
        return seq

    def progressed(self, seq) -> None:
        """`seq.generated` changed."""
        self.generated[self._row[seq.seq_id]] = seq.generated

    def giving_up(self, seq) -> None:
        """`seq` was told to give up: no longer counted as running."""
        self.running[self._row[seq.seq_id]] = False

    def _grow(self) -> None:
        n = 2 * len(self.generated)
        for name in ("generated", "prompt_len", "max_tokens", "running"):
            old = getattr(self, name)
            new = np.zeros(n, dtype=old.dtype)
            new[:len(old)] = old
            setattr(self, name, new)

    # --- what the policy reads -----------------------------------------------------------------
    def columns(self, running_only: bool = False) -> tuple:
        """(seqs, generated, prompt_len, max_tokens), row-aligned; the arrays are fresh copies
        (or masked selections) that later changes to the table do not touch."""
        n = len(self.rows)
        g, p, c = self.generated[:n], self.prompt_len[:n], self.max_tokens[:n]
        if running_only:
            run = self.running[:n]
            if not run.all():
                idx = np.flatnonzero(run)
                return [self.rows[i] for i in idx], g[idx], p[idx], c[idx]
        return list(self.rows), g.copy(), p.copy(), c.copy()
