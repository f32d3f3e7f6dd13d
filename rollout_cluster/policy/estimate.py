"""What a policy may believe about remaining work, without an oracle.

Only progress (`generated`), the `max_tokens` cap and the outcomes of group siblings are used.
In an RL batch every sequence starts together, so age alone separates little; siblings do:
lengths correlate within a prompt's group, so a sequence whose siblings are all still running
after many tokens is probably long, and one whose siblings mostly finished is probably near its end.
"""
from __future__ import annotations

import numpy as np

from ..engines.cost_model import CostModel
from ..state import GroupState, SeqState

TYPICAL_LENGTH_FLOOR = 64


def expected_remaining(seq: SeqState, group: GroupState | None, typical: float, use_group: bool = True) -> float:
    g = seq.generated
    cap = seq.max_tokens - g
    if use_group and group is not None and group.finished > 0:
        # Siblings still running are longer than the longest finished one (or than g); the
        # larger the running fraction, the further the group's lengths reach beyond it.
        base = max(g, group.finished_len_max)
        total = base * (1.0 + group.running / group.size)
    elif use_group and group is not None and group.size > 1:
        # No sibling finished yet: a group-wide long one. Heavy tail: E[L | L > g] ~ 2g.
        total = 2.0 * max(g, typical)
    else:
        total = max(2.0 * g, typical)
    return float(max(1.0, min(cap, total - g)))


def finish_time(remaining_and_context: list, cost: CostModel, scale: float = 1.0) -> float:
    """`finish_time_of` for a list of (remaining, context_tokens) pairs."""
    if not remaining_and_context:
        return 0.0
    arr = np.asarray(remaining_and_context, dtype=np.float64)
    return finish_time_of(arr[:, 0], arr[:, 1], cost, scale)


def finish_time_of(rem: np.ndarray, ctx: np.ndarray, cost: CostModel, scale: float = 1.0) -> float:
    """Seconds until the last of these sequences finishes on one replica, if they decode
    together and sequence i stops after rem[i] more tokens (ctx[i]: its context now).

    Sorted by remaining r_1 <= ... <= r_m, interval i (from r_{i-1} to r_i) runs b_i = m-i+1
    sequences whose context is sum_{j>=i} ctx_j + b_i * r_{i-1}, growing b_i tokens a step."""
    if len(rem) == 0:
        return 0.0
    order = np.argsort(rem, kind="stable")
    r, c = rem[order], ctx[order]
    prev = np.empty_like(r)
    prev[0] = 0.0
    prev[1:] = r[:-1]
    dt = r - prev
    batch = np.arange(len(r), 0, -1, dtype=np.float64)
    context = np.cumsum(c[::-1])[::-1] + batch * prev
    t = dt * (cost.a + cost.e * batch + cost.c * (context + batch * dt / 2.0))
    return float(t.sum()) * scale
