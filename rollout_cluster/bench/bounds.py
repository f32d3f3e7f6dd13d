"""The bounds every benchmark reports against (DESIGN.md "Lower bound"), in the cost model.

Notation: a sequence has prompt P and true length L; the cost model prices a decode step of a
batch of B sequences holding C context tokens at a + c*C + e*B, and prefill at P / rate. A
sequence's j-th token (j = 0..L-1) is decoded with its own context P + j, as in the simulator.

Prefix cache: the samples of one prompt (one `prompt_index`) share it, and the engines (vLLM's
prefix cache, and the simulator's: engines/prefix_cache.py) prefill it once per replica. At best
it is prefilled once in all, by the first of its group, so the bounds charge P/rate to the first
sequence of each group (in submission order) and none to its siblings.

- longest alone: P/rate + sum_j (a + e + c*(P + j)) = P/rate + L*(a + e) + c*(L*P + L*(L-1)/2),
  the maximum over sequences. No schedule finishes a sequence faster: its steps are serial and
  none is cheaper than batch 1 with its own context, and its prompt is prefilled on its replica
  before it decodes (by it or by a sibling), cache or not.
- work: total replica-seconds at full batch, divided by the R replicas. Each token pays its own
  e and c*context exactly; the step's a is shared by at most max_num_seqs tokens, so a token pays
  at least a / max_num_seqs: W = sum over groups of P/rate + sum over sequences of
  L*(a/B_max + e) + c*(L*P + L*(L-1)/2), and makespan >= W / R.
- lower bound = max(longest alone, W / R). Pre-emptions and re-prefills only add to it.
- balance bound: the makespan if at every step the active sequences and their context were spread
  perfectly evenly over the replicas (see `balance_bound`; `fluid_schedule` walks that schedule).
  A policy that isolates the tail on lightly loaded replicas may beat it; a policy that merely
  balances counts should not.
"""
from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

from ..engines.cost_model import CostModel


def request_shapes(requests) -> list:
    """(prompt tokens, true length) per sequence, in submission order: its hidden length (none:
    max_tokens), at least the one token every sequence makes, as the router runs it."""
    return [(r.prompt_len, max(1, min(r.sampling.max_tokens if r.hidden_length is None else r.hidden_length,
                                      r.sampling.max_tokens))) for r in requests]


def decode_alone_s(cost: CostModel, prompt: int, length: int) -> float:
    """Decode time of one sequence on its own: sum_j (a + e + c*(prompt + j)), j < length."""
    return length * (cost.a + cost.e) + cost.c * (length * prompt + length * (length - 1) / 2)


def alone_s(cost: CostModel, prompt: int, length: int) -> float:
    """Prefill plus decode of one sequence on an otherwise idle replica."""
    return cost.prefill_s(prompt) + decode_alone_s(cost, prompt, length)


def first_of_group(requests) -> list:
    """Per sequence, in submission order: whether it is the first of its group (prompt_index),
    the one that pays the shared prompt's prefill at best."""
    seen: set = set()
    out = []
    for r in requests:
        out.append(r.prompt_index not in seen)
        seen.add(r.prompt_index)
    return out


def work_s(cost: CostModel, prompt: int, length: int, cached: bool = False) -> float:
    """Replica-seconds one sequence costs at best: its prefill (none if `cached`: a sibling
    prefilled the prompt), its own e and context reads, and a 1/max_num_seqs share of each
    step's fixed cost a."""
    return ((0.0 if cached else cost.prefill_s(prompt)) + length * (cost.a / cost.max_num_seqs + cost.e)
            + cost.c * (length * prompt + length * (length - 1) / 2))


def lower_bound(requests, cost: CostModel, replicas: int) -> dict:
    """{longest_alone_s, work_s (total replica-seconds), lower_bound_s}."""
    shape = request_shapes(requests)
    longest = max((alone_s(cost, p, n) for p, n in shape), default=0.0)
    work = sum(work_s(cost, p, n, not first) for (p, n), first in zip(shape, first_of_group(requests)))
    return {"longest_alone_s": longest, "work_s": work, "lower_bound_s": max(longest, work / replicas)}


def balance_bound(requests, cost: CostModel, replicas: int) -> float:
    """The fluid, perfectly balanced schedule's makespan, at least each sequence's own floor.

    All active sequences decode in lock step. With A active sequences holding C context tokens,
    each replica runs a batch of A/R holding C/R context: a step costs a + e*max(1, A/R) + c*C/R.
    Over an interval of k steps (until the next sequence ends) C grows by A a step, so the
    interval costs k*(a + e*max(1, A/R)) + c*(k*C + A*k(k-1)/2)/R. At most R*max_num_seqs
    sequences are active; the rest queue in submission order and start as others end. Admitting
    a set of sequences costs the sum of their prompts / R / rate, counting only the first sequence
    of each group (a perfect prefix cache: siblings admitted later find the prompt cached).
    A sequence is indivisible: it ends no sooner than its admission plus its time alone (prefill
    and decode at batch 1), so the makespan is the larger of the fluid schedule's end and every
    sequence's admission + alone_s. (Charging every replica the largest sequence's context or
    prompt instead, in lock step, put the bound above placements that only balance: one sequence
    a replica.) KV capacity is not modelled. The result is at least the lower bound's longest alone.
    It is a reference for fleets of many sequences a replica, not a bound for a handful: an
    admission's prefill is charged to everything it admits, in lock step, so one short prompt
    beside a long one on another replica starts decoding later here than it does alone.
    """
    t = 0.0
    shape, first = request_shapes(requests), first_of_group(requests)
    group_t: dict = {}  # prompt_index -> when its first sequence was admitted (its prompt's prefill began)
    for interval in fluid_schedule(requests, cost, replicas):
        admitted_t = interval.t - interval.prefill_s
        for i in interval.admitted:
            group_t.setdefault(requests[i].prompt_index, admitted_t)
        # A sibling decodes once admitted, and no sooner than its group's prompt is prefilled: at
        # least the group's first admission + its prefill and its own decode alone.
        t = max(t, interval.t + interval.seconds,
                *(max(admitted_t + (alone_s if first[i] else decode_alone_s)(cost, *shape[i]),
                      group_t[requests[i].prompt_index] + alone_s(cost, *shape[i])) for i in interval.admitted))
    return t


@dataclass(frozen=True)
class FluidInterval:
    """A run of lock-step decode steps of the fluid schedule between two sequence ends."""

    t: float  # when it begins: after the prefill of the sequences admitted just before it
    steps: int  # decode steps done before it
    k: int  # its steps: until the next active sequence ends
    active: int  # sequences decoding through it
    context: int  # their context tokens at its start
    seconds: float  # its duration: fluid_steps_s(cost, replicas, active, context, k)
    admitted: tuple  # indices (submission order) of the sequences admitted at its start
    prefill_s: float = 0.0  # the admission's prefill, just before t (t - prefill_s: when they were admitted)


def fluid_steps_s(cost: CostModel, replicas: int, active: int, context: int, k: int) -> float:
    """Seconds of the first k steps of a fluid interval: `active` sequences holding `context`
    tokens at its start, spread evenly over the replicas (see `balance_bound`)."""
    r = float(replicas)
    return k * (cost.a + cost.e * max(1.0, active / r)) + cost.c * (k * context + active * k * (k - 1) / 2) / r


def fluid_schedule(requests, cost: CostModel, replicas: int):
    """The fluid, perfectly balanced schedule of `balance_bound`, one interval at a time.

    Yields a FluidInterval for each run of steps until the next sequence ends, in time order; the
    schedule's makespan is the last one's t + seconds (0 with no requests).
    """
    shape = request_shapes(requests)
    first = first_of_group(requests)
    r = float(replicas)
    slots = replicas * cost.max_num_seqs
    queue = deque(range(len(shape)))
    ends: list = []  # (end step, index) of active sequences
    t, steps, active, context = 0.0, 0, 0, 0

    def admit() -> tuple:
        """Queued sequences into free slots: (their indices, the seconds to prefill them)."""
        nonlocal active, context
        admitted, tokens = [], 0
        while queue and active < slots:
            i = queue.popleft()
            p, n = shape[i]
            heapq.heappush(ends, (steps + n, i))
            admitted.append(i)
            active += 1
            context += p
            if first[i]:
                tokens += p
        return tuple(admitted), tokens / r / cost.prefill_tokens_per_s

    admitted, prefill = admit()
    t += prefill
    while active:
        k = ends[0][0] - steps
        seconds = fluid_steps_s(cost, replicas, active, context, k)
        yield FluidInterval(t, steps, k, active, context, seconds, admitted, prefill)
        t += seconds
        steps += k
        context += active * k
        while ends and ends[0][0] == steps:
            _, i = heapq.heappop(ends)
            active -= 1
            context -= shape[i][0] + shape[i][1]
        admitted, prefill = admit()
        t += prefill


def bounds(requests, cost: CostModel, replicas: int) -> dict:
    """Everything a report needs: lower bound (and its two terms) and the balance bound."""
    out = lower_bound(requests, cost, replicas)
    out["balance_bound_s"] = balance_bound(requests, cost, replicas)
    return out
