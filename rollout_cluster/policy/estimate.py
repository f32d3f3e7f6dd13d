"""What a policy may believe about remaining work, without an oracle.

Only progress (`generated`), the `max_tokens` cap and the outcomes of group siblings are used.
In an RL batch every sequence starts together, so age alone separates little; siblings do:
lengths correlate within a prompt's group, so a sequence whose siblings are all still running
after many tokens is probably long, and one whose siblings mostly finished is probably near its end.
"""
from __future__ import annotations

import math

import numpy as np

from ..engines.cost_model import CostModel
from ..router.state import GroupState, SeqState

TYPICAL_LENGTH_FLOOR = 64
GROUP_SIGMA = 0.5  # spread of log-length within a prompt's group (prior; no oracle)
_SQRT2 = math.sqrt(2.0)


def _phi_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / _SQRT2))


def _phi_inv(p: float) -> float:
    """Inverse standard normal CDF (Acklam's rational approximation, |error| < 1.2e-9)."""
    a = (-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02, 1.383577518672690e+02,
         -3.066479806614716e+01, 2.506628277459239e+00)
    b = (-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02, 6.680131188771972e+01,
         -1.328068155288572e+01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00, -2.549671010243243e+00,
         4.374664141464968e+00, 2.938163982698783e+00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00, 3.754408661907416e+00)
    if p < 0.02425:
        q = math.sqrt(-2 * math.log(p))
        return (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / \
            ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1)
    if p > 1 - 0.02425:
        return -_phi_inv(1 - p)
    q = p - 0.5
    r = q * q
    return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q / \
        (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)


def lognormal_remaining(g: float, mu: float, sigma: float, cap: float) -> float:
    """E[min(L, cap) - g | L > g] for log L ~ N(mu, sigma^2)."""
    lg, lc = math.log(max(g, 1.0)), math.log(cap)
    surv = 1.0 - _phi_cdf((lg - mu) / sigma)
    if surv < 1e-12 or cap <= g:
        return max(1.0, cap - g) if cap > g else 1.0
    mean_part = math.exp(mu + sigma * sigma / 2) * (
        _phi_cdf((lc - mu - sigma * sigma) / sigma) - _phi_cdf((lg - mu - sigma * sigma) / sigma))
    beyond_cap = cap * (1.0 - _phi_cdf((lc - mu) / sigma))
    return max(1.0, (mean_part + beyond_cap) / surv - g)


def expected_remaining(seq: SeqState, group: GroupState | None, typical: float, use_group: bool = True,
                       sigma: float = GROUP_SIGMA) -> float:
    """Expected tokens left, from the group's finished fraction at this age.

    A prompt's samples start together, so when k of its n samples have finished by the time the
    rest reached g tokens, Phi((ln g - mu)/sigma) ~ (k + 0.5)/(n + 1) gives the group's log-median
    mu; the expected remaining length then follows from the lognormal tail beyond g, capped at
    max_tokens. A group still whole after g tokens is long; a group mostly done is near its end."""
    g = seq.generated
    cap = seq.max_tokens
    if use_group and group is not None and group.size > 1:
        p = (group.finished + 0.5) / (group.size + 1.0)
        mu = math.log(max(g, typical / 4, 1.0)) - sigma * _phi_inv(p)
        return lognormal_remaining(g, mu, sigma, cap)
    total = max(2.0 * g, typical)
    return float(max(1.0, min(cap - g, total - g)))


_ERF_P = 0.3275911
_ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def _phi_cdf_array(x: np.ndarray) -> np.ndarray:
    """Standard normal CDF of an array (Abramowitz-Stegun 7.1.26 erf, |error| < 1.5e-7)."""
    z = np.abs(x) / _SQRT2
    t = 1.0 / (1.0 + _ERF_P * z)
    a1, a2, a3, a4, a5 = _ERF_A
    erf = 1.0 - (((((a5 * t + a4) * t + a3) * t + a2) * t + a1) * t) * np.exp(-z * z)
    return 0.5 * (1.0 + np.copysign(erf, x))


def expected_remaining_array(g: np.ndarray, cap: np.ndarray, size: np.ndarray, finished: np.ndarray,
                             typical: float, sigma: float = GROUP_SIGMA) -> np.ndarray:
    """`expected_remaining` of many sequences at once (generated g, cap, their group's size and
    finished count; size <= 1 means no group information). O(n) numpy: the steal policy's hot path."""
    out = np.maximum(1.0, np.minimum(cap - g, np.maximum(2.0 * g, typical) - g))
    grouped = size > 1
    if not grouped.any():
        return out
    g_, cap_ = g[grouped], cap[grouped]
    z = _quantile_of_finished(size[grouped], finished[grouped])
    lg = np.log(np.maximum(g_, 1.0))
    mu = np.log(np.maximum(np.maximum(g_, typical / 4), 1.0)) - sigma * z
    lc = np.log(cap_)
    s2 = sigma * sigma
    # One call for the four CDFs (numpy's per-call cost dominates at a replica's batch size).
    cdf = _phi_cdf_array(np.stack(((lg - mu) / sigma, (lc - mu - s2) / sigma, (lg - mu - s2) / sigma,
                                   (lc - mu) / sigma)))
    surv = 1.0 - cdf[0]
    mean_part = np.exp(mu + s2 / 2) * (cdf[1] - cdf[2])
    beyond_cap = cap_ * (1.0 - cdf[3])
    with np.errstate(divide="ignore", invalid="ignore"):
        tail = np.maximum(1.0, (mean_part + beyond_cap) / surv - g_)
    degenerate = (surv < 1e-12) | (cap_ <= g_)
    tail = np.where(degenerate, np.where(cap_ > g_, np.maximum(1.0, cap_ - g_), 1.0), tail)
    out[grouped] = tail
    return out


_QUANTILES: dict = {}  # (group size, finished) -> _phi_inv((finished + 0.5) / (size + 1))
_QUANTILES_KEPT = 1 << 16  # (pairs seen: at most this many kept, the oldest forgotten first)


def _quantile_of_finished(size: np.ndarray, finished: np.ndarray) -> np.ndarray:
    """_phi_inv((finished + 0.5) / (size + 1)) per sequence, computed once per (size, finished)
    pair present (a table of every pair up to the largest group would be size^2: a group of
    limits.max_n samples would not fit in memory)."""
    m = size.astype(np.int64)
    k = np.minimum(finished, size).astype(np.int64)
    pairs, where = np.unique(np.stack((m, k)), axis=1, return_inverse=True)
    values = np.empty(pairs.shape[1])
    for j, (mm, kk) in enumerate(pairs.T.tolist()):
        q = _QUANTILES.get((mm, kk))
        if q is None:
            q = _QUANTILES[(mm, kk)] = _phi_inv((kk + 0.5) / (mm + 1.0))
            if len(_QUANTILES) > _QUANTILES_KEPT:
                _QUANTILES.pop(next(iter(_QUANTILES)))
        values[j] = q
    return values[where.reshape(-1)]


def own_costs(rem: np.ndarray, ctx: np.ndarray, cost: CostModel) -> np.ndarray:
    """Each sequence's own share of the step costs while it runs rem more tokens from context
    ctx: e per step, and c per context token per step (its context grows by one a step)."""
    return cost.e * rem + cost.c * (ctx * rem + rem * rem / 2.0)


def finish_time_of(rem: np.ndarray, ctx: np.ndarray, cost: CostModel, scale: float = 1.0) -> float:
    """Seconds until the last of these sequences finishes on one replica, if they decode
    together and sequence i stops after rem[i] more tokens (ctx[i]: its context now).

    The step cost a + c*context + e*batch is additive over the batch: the replica pays `a` once
    a step for as long as anything runs (the longest remaining), and every sequence pays its
    own e and c terms for its own steps (`own_costs`). So the estimate is O(n) with no sort, and
    the estimate after adding or removing sequences is a sum and a max away."""
    if len(rem) == 0:
        return 0.0
    return float(cost.a * rem.max() + own_costs(rem, ctx, cost).sum()) * scale
