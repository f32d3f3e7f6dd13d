"""The policy's finish-time estimate against a step-by-step reference, and steal's evaluation of
every move count against brute force."""
import random

import numpy as np
import pytest

from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import PROFILES
from rollout_cluster.policy.estimate import finish_time_of
from rollout_cluster.policy.steal import MIGRATION_OVERHEAD_S, Load, StealPolicy

COST = PROFILES["a100-80g-7b"]


def stepwise(rem, ctx, cost):
    """Decode step by step: every step costs a + c*context + e*batch; sequences stop after rem."""
    rem, ctx = list(rem), list(ctx)
    t, done = 0.0, 0
    while any(r > done for r in rem):
        live = [i for i, r in enumerate(rem) if r > done]
        t += cost.a + cost.e * len(live) + cost.c * sum(ctx[i] + done for i in live)
        done += 1
    return t


@pytest.mark.parametrize("seed", range(4))
def test_finish_time_of_matches_stepwise_decoding(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 40))
    rem = rng.integers(1, 400, n).astype(float)
    ctx = rng.integers(16, 3000, n).astype(float)
    want = stepwise(rem, ctx, COST)
    # The closed form integrates the context growth continuously (r^2/2 against r(r-1)/2).
    assert finish_time_of(rem, ctx, COST) == pytest.approx(want, rel=2e-3)
    assert finish_time_of(rem, ctx, COST, scale=2.0) == pytest.approx(2 * want, rel=2e-3)


def test_one_sequence_alone_and_in_a_crowd():
    alone = finish_time_of(np.array([100.0]), np.array([50.0]), COST)
    crowded = finish_time_of(np.array([100.0] + [60.0] * 200), np.array([50.0] * 201), COST)
    assert alone == pytest.approx(stepwise([100], [50], COST), rel=2e-3)
    assert crowded == pytest.approx(stepwise([100] + [60] * 200, [50] * 201, COST), rel=2e-3)
    assert crowded > alone


@pytest.mark.parametrize("seed", range(6))
def test_best_k_equals_brute_force_over_every_k(seed):
    rng = np.random.default_rng(seed)
    policy = StealPolicy(PolicyConfig(name="steal"), COST)
    nv, nr = int(rng.integers(2, 200)), int(rng.integers(0, 20))
    theirs = Load(rng.integers(1, 6000, nv).astype(float), rng.integers(16, 9000, nv).astype(float), [None] * nv, COST)
    mine = Load(rng.integers(1, 3000, nr).astype(float), rng.integers(16, 9000, nr).astype(float), [None] * nr, COST)
    movable = [int(i) for i in np.argsort(-theirs.rem, kind="stable") if rng.random() < 0.7][:32]
    scale_v, scale_r = 1.0 + rng.random(), 0.5 + rng.random()
    k, t, t_v_after, t_r_after = policy._best_k(theirs, movable, mine, scale_v, scale_r)
    brute, victim_after, thief_after = [], [], []
    for j in range(len(movable) + 1):
        moved = movable[:j]
        rest = np.ones(nv, dtype=bool)
        rest[moved] = False
        t_v = finish_time_of(theirs.rem[rest], theirs.ctx[rest], COST, scale_v)
        t_r = finish_time_of(np.concatenate((mine.rem, theirs.rem[moved])),
                             np.concatenate((mine.ctx, theirs.ctx[moved])), COST, scale_r)
        if j:
            t_r += theirs.ctx[moved].sum() / COST.prefill_tokens_per_s * scale_r + MIGRATION_OVERHEAD_S
        brute.append(max(t_v, t_r))
        victim_after.append(t_v)
        thief_after.append(t_r)
    assert t == pytest.approx(min(brute), rel=1e-9)
    assert brute[k] == pytest.approx(min(brute), rel=1e-9)
    assert t_v_after == pytest.approx(victim_after[k], rel=1e-9)  # the victim's estimate after the move
    assert t_r_after == pytest.approx(thief_after[k], rel=1e-9)  # the thief's own, not the later of the two


class _Seq:
    def __init__(self, generated: int, max_tokens: int):
        self.generated, self.max_tokens = generated, max_tokens


@pytest.mark.parametrize("seed", [0, 1])
def test_expected_remaining_array_matches_the_scalar_estimate(seed):
    """The steal policy's vectorised group estimate equals estimate.expected_remaining (within
    the erf approximation), for groups of every size and progress, with and without siblings."""
    from rollout_cluster.policy.estimate import expected_remaining, expected_remaining_array
    from rollout_cluster.router.state import GroupState
    rng = random.Random(seed)
    seqs, groups = [], []
    for _ in range(3000):
        size = rng.choice([1, 2, 4, 16, 100])
        cap = rng.choice([64, 2048, 16384])
        seqs.append(_Seq(rng.randint(0, cap), cap))
        groups.append(GroupState(size, rng.randint(0, size - 1)))
    ref = np.array([expected_remaining(s, g, 300.0) for s, g in zip(seqs, groups)])
    got = expected_remaining_array(np.array([s.generated for s in seqs], dtype=float),
                                   np.array([s.max_tokens for s in seqs], dtype=float),
                                   np.array([g.size for g in groups], dtype=float),
                                   np.array([g.finished for g in groups], dtype=float), 300.0)
    assert np.all(np.abs(got - ref) <= 1e-4 * np.maximum(ref, 1.0))
    # The evidence matters: a whole group still running is expected to run longer than one mostly done.
    whole = expected_remaining_array(np.array([1000.0]), np.array([16384.0]), np.array([16.0]), np.array([0.0]), 300.0)
    done = expected_remaining_array(np.array([1000.0]), np.array([16384.0]), np.array([16.0]), np.array([14.0]), 300.0)
    assert whole[0] > 3 * done[0]
