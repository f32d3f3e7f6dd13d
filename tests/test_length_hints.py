"""experiments/length-hints/run.py: its per-prompt hints, its hinted steal variants and the additive
account of the balance bound."""
import math

import numpy as np
import pytest

from rollout_cluster.bench.bounds import balance_bound, bounds
from rollout_cluster.bench.workloads import LongtailSpec, prompt_difficulties, rl_longtail
from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.sim.simulator import Simulation

SPEC = LongtailSpec(prompts=16, samples=8, median=300.0, max_tokens=2048, seed=2, prompt_min=32, prompt_max=128)


def test_difficulties_are_the_medians_the_batch_was_drawn_around():
    spec = LongtailSpec(prompts=64, samples=32, median=300.0, sigma_sample=0.3, max_tokens=1 << 20, seed=5)
    reqs = rl_longtail(spec)
    diff = prompt_difficulties(spec)
    assert len(diff) == spec.prompts
    for p, d in enumerate(diff):
        logs = [math.log(r.hidden_length) for r in reqs if r.prompt_index == p]
        # 32 samples of sigma 0.3: the mean log length is within 4 standard errors of log d
        assert abs(sum(logs) / len(logs) - math.log(d)) < 4 * 0.3 / math.sqrt(32) + 1e-3


def test_hints_are_exact_without_history_and_drift_and_noisier_with_them(length_hints):
    exact = length_hints.prompt_hints(SPEC, history=0, drift=0.0)
    assert exact == pytest.approx(prompt_difficulties(SPEC))
    truth = np.log(prompt_difficulties(LongtailSpec(prompts=400, seed=3)))

    def error(history, drift):
        hints = np.log(length_hints.prompt_hints(LongtailSpec(prompts=400, seed=3), history, drift))
        return float(np.sqrt(np.mean((hints - truth) ** 2)))

    assert error(64, 0.0) < error(4, 0.0) < error(4, 0.5)
    assert error(16, 0.0) == pytest.approx(0.5 / 4, rel=0.25)  # sigma_sample / sqrt(history)


def test_hinted_estimate_ranks_a_hard_prompt_above_an_easy_one_and_the_batch_completes_once(length_hints):
    cost = load_profile("a100-80g-7b", max_num_seqs=16)
    reqs = rl_longtail(SPEC)
    hints = length_hints.prompt_hints(SPEC, 0, 0.0)
    policy = length_hints.HintSteal(PolicyConfig(name="steal"), cost, hints)
    seen = []
    load = policy._load

    def spy(view, rep, typical, starts=(), running_only=False):
        out = load(view, rep, typical, starts, running_only)
        seen.extend((s.request.prompt_index, s.generated, r) for s, r in zip(out.seqs, out.rem))
        return out

    policy._load = spy
    res = Simulation(policy, cost, 4, trace=False, record_tokens=True).run(reqs)
    assert all(c is not None and len(c.token_ids) == q.hidden_length for c, q in zip(res.completions, reqs))
    fresh = {p: r for p, g, r in seen if g == 0}
    hard, easy = max(fresh, key=lambda p: hints[p]), min(fresh, key=lambda p: hints[p])
    assert fresh[hard] > 3 * fresh[easy]


def test_two_class_placement_keeps_the_hardest_prompts_alone_on_the_tail_replicas(length_hints):
    cost = load_profile("a100-80g-7b", max_num_seqs=16)
    reqs = rl_longtail(SPEC)
    hints = length_hints.prompt_hints(SPEC, 0, 0.0)
    policy = length_hints.TwoClassHintSteal(PolicyConfig(name="steal"), cost, hints, tail_groups=2, tail_replicas=1)
    res = Simulation(policy, cost, 4, trace=False).run(reqs)
    hardest = set(sorted(range(SPEC.prompts), key=lambda p: -hints[p])[:2])
    (tail,) = policy.tail_set
    for c in res.completions:
        assert (c.replicas[0] == tail) == (c.prompt_index in hardest)


@pytest.mark.parametrize("max_tokens", [512, 2048])
def test_additive_account_is_a_lower_estimate_close_to_the_balance_bound(length_hints, max_tokens):
    cost = load_profile("a100-80g-7b")
    spec = LongtailSpec(prompts=32, samples=8, median=300.0, max_tokens=max_tokens, seed=2, prompt_min=32, prompt_max=128)
    reqs = rl_longtail(spec)
    additive, balance = length_hints.additive_balance(reqs, cost, 4), balance_bound(reqs, cost, 4)
    assert additive <= balance <= 1.02 * additive
    assert additive > bounds(reqs, cost, 4)["lower_bound_s"]


def test_greedy_placement_fills_within_capacity_and_is_priced_by_the_additive_model(length_hints):
    cost = load_profile("a100-80g-7b")
    reqs = rl_longtail(SPEC)
    makespan, where = length_hints.greedy_placement(reqs, cost, 4, 40)
    assert np.bincount(where, minlength=4).max() <= 40 and len(where) == len(reqs)
    lengths = np.array([q.hidden_length for q in reqs], dtype=np.float64)
    own = length_hints.own_costs(lengths, np.array([q.prompt_len for q in reqs], dtype=np.float64), cost)
    per_replica = [cost.a * lengths[where == r].max() + own[where == r].sum() for r in range(4)]
    assert makespan == pytest.approx(max(per_replica))
    round_robin = np.arange(len(reqs)) % 4
    assert makespan < max(cost.a * lengths[round_robin == r].max() + own[round_robin == r].sum() for r in range(4))


def test_rl_longtail_draws_the_stream_every_recorded_result_came_from():
    """The lengths, prompts and ids of seed 0 as generated before the generator was shared with
    prompt_difficulties: every number in experiments/*/results depends on this stream."""
    spec = LongtailSpec(prompts=3, samples=4, seed=0)
    reqs = rl_longtail(spec, vocab_size=32000)
    assert [r.hidden_length for r in reqs] == [1096, 413, 960, 1397, 2432, 984, 5383, 3877, 8801, 6175, 5620, 1891]
    assert [r.prompt_len for r in reqs[::4]] == [779, 357, 817]
    assert reqs[0].prompt_token_ids[:4] == [8901, 2254, 6059, 13164]
    assert prompt_difficulties(spec) == pytest.approx([1271.228, 1803.817, 3216.116], abs=1e-3)
