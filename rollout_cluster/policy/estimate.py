"""What a policy may believe about remaining work, without an oracle.

Only progress (`generated`), the `max_tokens` cap and the outcomes of group siblings are used.
In an RL batch every sequence starts together, so age alone separates little; siblings do:
lengths correlate within a prompt's group, so a sequence whose siblings are all still running
after many tokens is probably long, and one whose siblings mostly finished is probably near its end.
"""
from __future__ import annotations

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
    """Seconds until the last of these sequences finishes on one replica, if they decode
    together and each stops after its remaining tokens. Items: (remaining, context_tokens)."""
    if not remaining_and_context:
        return 0.0
    items = sorted(remaining_and_context)
    batch = len(items)
    context = sum(ctx for _, ctx in items)
    t = 0.0
    done = 0.0
    for rem, ctx in items:
        dt = rem - done
        if dt > 0:
            # context grows by `batch` tokens a step; use the interval's mean
            t += dt * (cost.a + cost.c * (context + batch * dt / 2.0) + cost.e * batch)
            context += batch * dt
        context -= ctx + rem
        batch -= 1
        done = rem
    return t * scale
