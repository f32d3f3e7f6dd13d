"""bounds.fluid_schedule, the fluid schedule behind balance_bound and the isolation script's
informed bound: by hand on three sequences, and against a step-by-step recomputation."""
import dataclasses

import pytest

from rollout_cluster.bench.bounds import (FluidInterval, alone_s, balance_bound, decode_alone_s, first_of_group,
                                          fluid_schedule, fluid_steps_s, lower_bound)
from rollout_cluster.bench.workloads import LongtailSpec, rl_longtail
from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import CostModel, load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import SamplingSpec, SequenceRequest
from rollout_cluster.sim.simulator import Simulation

# One slot per replica, so that with two replicas a third sequence queues.
TOY = CostModel(name="toy", a=1.0, c=0.25, e=0.5, prefill_tokens_per_s=2.0, kv_tokens=10**6, max_num_seqs=1)


def seq(prompt_index, sample_index, prompt, length):
    return SequenceRequest(None, SamplingSpec(max_tokens=4096, ignore_eos=True), prompt_index, sample_index,
                           hidden_length=length, prompt_len=prompt)


def test_three_sequences_on_two_replicas_by_hand():
    # 0 and 2 share a prompt of 4 tokens; 1 has its own of 2. Lengths 3, 1, 2.
    reqs = [seq(0, 0, 4, 3), seq(1, 0, 2, 1), seq(0, 1, 4, 2)]
    intervals = list(fluid_schedule(reqs, TOY, 2))
    # 0 and 1 start: prefill (4 + 2) / 2 / 2 = 1.5 s. One step (1 ends) with 6 context tokens:
    # 1 * (a + e * max(1, 2/2)) + c * 6/2 = 1.5 + 0.75 = 2.25 s.
    # Then 2 starts, its prompt cached (no prefill): contexts 5 and 4, then 6 and 5, until both end:
    # 2 * 1.5 + c * (9 + 11)/2 = 3 + 2.5 = 5.5 s: the fluid schedule ends at 9.25 s.
    assert intervals == [FluidInterval(t=1.5, steps=0, k=1, active=2, context=6, seconds=2.25, admitted=(0, 1),
                                       prefill_s=1.5),
                         FluidInterval(t=3.75, steps=1, k=2, active=2, context=9, seconds=5.5, admitted=(2,))]
    # ... but 0, admitted at 0, cannot end before its prefill (2 s) and 3 steps alone: 4.5 + c * (12 + 3)
    assert balance_bound(reqs, TOY, 2) == 2.0 + 4.5 + 0.25 * 15 == 10.25
    # the first step of the second interval alone: c * 9/2
    assert fluid_steps_s(TOY, 2, 2, 9, 1) == 1.5 + 0.25 * 9 / 2
    assert fluid_steps_s(TOY, 2, 2, 9, 0) == 0.0
    assert list(fluid_schedule([], TOY, 2)) == [] and balance_bound([], TOY, 2) == 0.0


@pytest.mark.parametrize("policy", ["static", "least-loaded", "pull", "steal"])
def test_no_placement_of_one_sequence_a_replica_beats_the_balance_bound(policy):
    """Regression (review): two sequences of two groups on two replicas, one each, each at batch 1:
    the makespan is the longest alone. The bound charged every replica the largest sequence's
    context (c*max(C/R, Cmax)) in lock step, and ended 0.5 % after every policy. (Prefill is made
    free here: an admission's prefill is charged to all it admits, in lock step, which the bound's
    docstring says a fleet of a few sequences a replica can beat.)"""
    cost = dataclasses.replace(load_profile("a100-80g-7b"), prefill_tokens_per_s=1e12)
    reqs = [seq(0, 0, 8000, 500), seq(1, 0, 16, 3000)]
    res = Simulation(make_policy(PolicyConfig(name=policy), cost), cost, 2, trace=False).run(reqs)
    longest = max(alone_s(cost, r.prompt_len, r.hidden_length) for r in reqs)
    assert res.makespan_s == pytest.approx(longest, rel=1e-9)
    assert lower_bound(reqs, cost, 2)["lower_bound_s"] <= balance_bound(reqs, cost, 2) <= res.makespan_s * (1 + 1e-9)


def step_by_step(requests, cost, replicas):
    """The fluid schedule recomputed one step at a time from explicit per-sequence contexts.
    Returns (makespan: the fluid end or a sequence's admission + its time alone, {index: step it
    starts}, {s: time when s steps are done})."""
    shape = [(r.prompt_len, r.hidden_length) for r in requests]
    first = first_of_group(requests)
    queued, running, start, done_at = list(range(len(shape))), {}, {}, {}
    t, step, floor = 0.0, 0, 0.0
    while queued or running:
        prompts = []
        while queued and len(running) < replicas * cost.max_num_seqs:
            i = queued.pop(0)
            running[i], start[i] = list(shape[i]), step  # [context, tokens left]
            if first[i]:
                prompts.append(shape[i][0])
            floor = max(floor, t + (cost.prefill_s(shape[i][0]) if first[i] else 0.0)
                        + sum(cost.a + cost.e + cost.c * (shape[i][0] + j) for j in range(shape[i][1])))
        t += sum(prompts) / replicas / cost.prefill_tokens_per_s
        # the batch is fixed until one of it ends; the context terms are summed over those steps
        fixed = cost.a + cost.e * max(1.0, len(running) / replicas)
        even = 0.0
        j = 0
        while True:
            contexts = [c for c, _ in running.values()]
            even, j = even + sum(contexts) / replicas, j + 1
            done_at[step + j] = t + j * fixed + cost.c * even
            for s in running.values():
                s[0], s[1] = s[0] + 1, s[1] - 1
            if any(left == 0 for _, left in running.values()):
                break
        t, step = done_at[step + j], step + j
        running = {i: s for i, s in running.items() if s[1] > 0}
    t = max(t, floor)
    return t, start, done_at


@pytest.mark.parametrize("seed,replicas,max_num_seqs", [(0, 2, 3), (1, 3, 2), (2, 4, 64)])
def test_fluid_schedule_matches_a_step_by_step_recomputation(headroom, seed, replicas, max_num_seqs):
    cost = CostModel(name="toy", a=1e-2, c=1e-4, e=1e-3, prefill_tokens_per_s=1000.0, kv_tokens=10**6,
                     max_num_seqs=max_num_seqs)
    reqs = rl_longtail(LongtailSpec(prompts=6, samples=4, median=200, max_tokens=1024, seed=seed,
                                    prompt_min=16, prompt_max=64))
    makespan, start, done_at = step_by_step(reqs, cost, replicas)
    intervals = list(fluid_schedule(reqs, cost, replicas))
    for iv in intervals:
        assert iv.t + iv.seconds == pytest.approx(done_at[iv.steps + iv.k], rel=1e-12)
        assert all(start[i] == iv.steps for i in iv.admitted)
    assert sorted(i for iv in intervals for i in iv.admitted) == list(range(len(reqs)))
    assert balance_bound(reqs, cost, replicas) == pytest.approx(makespan, rel=1e-12)

    longest = max(range(len(reqs)), key=lambda i: reqs[i].hidden_length)
    prompt, length = reqs[longest].prompt_len, reqs[longest].hidden_length
    marks = [1, 10, length // 2, length]
    work = lower_bound(reqs, cost, replicas)["work_s"] / replicas
    informed = headroom.informed_bound(reqs, cost, replicas, marks)
    assert informed == pytest.approx({g: max(work, done_at[start[longest] + g]
                                             + decode_alone_s(cost, prompt + g, length - g)) for g in marks},
                                     rel=1e-12)
