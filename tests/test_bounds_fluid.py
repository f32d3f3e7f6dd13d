"""bounds.fluid_schedule, the fluid schedule behind balance_bound and the isolation script's
informed bound: by hand on three sequences, and against a step-by-step recomputation."""
import pytest

from rollout_cluster.bench.bounds import (FluidInterval, balance_bound, decode_alone_s, first_of_group,
                                          fluid_schedule, fluid_steps_s, lower_bound)
from rollout_cluster.bench.workloads import LongtailSpec, rl_longtail
from rollout_cluster.engines.cost_model import CostModel
from rollout_cluster.protocol import SamplingSpec, SequenceRequest

# One slot per replica, so that with two replicas a third sequence queues.
TOY = CostModel(name="toy", a=1.0, c=0.25, e=0.5, prefill_tokens_per_s=2.0, kv_tokens=10**6, max_num_seqs=1)


def seq(prompt_index, sample_index, prompt, length):
    return SequenceRequest(None, SamplingSpec(max_tokens=4096, ignore_eos=True), prompt_index, sample_index,
                           hidden_length=length, prompt_len=prompt)


def test_three_sequences_on_two_replicas_by_hand():
    # 0 and 2 share a prompt of 4 tokens; 1 has its own of 2. Lengths 3, 1, 2.
    reqs = [seq(0, 0, 4, 3), seq(1, 0, 2, 1), seq(0, 1, 4, 2)]
    intervals = list(fluid_schedule(reqs, TOY, 2))
    # 0 and 1 start: prefill max((4 + 2) / 2, 4) / 2 = 2 s. One step (1 ends) with contexts 4 and 2:
    # 1 * (a + e * max(1, 2/2)) + c * max(6/2, 4) = 1.5 + 1 = 2.5 s.
    # Then 2 starts, its prompt cached (no prefill): contexts 5 and 4, then 6 and 5, until both end:
    # 2 * 1.5 + c * max(9/2 + 11/2, 5 + 6) = 3 + 2.75 = 5.75 s.
    assert intervals == [FluidInterval(t=2.0, steps=0, k=1, active=2, context=6, cmax=4, seconds=2.5, admitted=(0, 1)),
                         FluidInterval(t=4.5, steps=1, k=2, active=2, context=9, cmax=5, seconds=5.75, admitted=(2,))]
    assert balance_bound(reqs, TOY, 2) == 10.25
    # the first step of the second interval alone: c * max(9/2, 5)
    assert fluid_steps_s(TOY, 2, 2, 9, 5, 1) == 1.5 + 0.25 * 5
    assert fluid_steps_s(TOY, 2, 2, 9, 5, 0) == 0.0
    assert list(fluid_schedule([], TOY, 2)) == [] and balance_bound([], TOY, 2) == 0.0


def step_by_step(requests, cost, replicas):
    """The fluid schedule recomputed one step at a time from explicit per-sequence contexts.
    Returns (makespan, {index: step it starts}, {s: time when s steps are done})."""
    shape = [(r.prompt_len, r.hidden_length) for r in requests]
    first = first_of_group(requests)
    queued, running, start, done_at = list(range(len(shape))), {}, {}, {}
    t, step = 0.0, 0
    while queued or running:
        prompts = []
        while queued and len(running) < replicas * cost.max_num_seqs:
            i = queued.pop(0)
            running[i], start[i] = list(shape[i]), step  # [context, tokens left]
            if first[i]:
                prompts.append(shape[i][0])
        t += max(sum(prompts) / replicas, max(prompts, default=0)) / cost.prefill_tokens_per_s
        # the batch is fixed until one of it ends; the context terms are summed over those steps
        fixed = cost.a + cost.e * max(1.0, len(running) / replicas)
        even = own = 0.0
        j = 0
        while True:
            contexts = [c for c, _ in running.values()]
            even, own, j = even + sum(contexts) / replicas, own + max(contexts), j + 1
            done_at[step + j] = t + j * fixed + cost.c * max(even, own)
            for s in running.values():
                s[0], s[1] = s[0] + 1, s[1] - 1
            if any(left == 0 for _, left in running.values()):
                break
        t, step = done_at[step + j], step + j
        running = {i: s for i, s in running.items() if s[1] > 0}
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
