"""`steal`: pull dispatch, then work-stealing once the global queue is empty.

Algorithm, at a pull by replica R with free slots and nothing queued (rate-limited per replica):
1. Estimate R's finish time T_R; every other replica's estimate is the one made at its own
   latest pull, aged by the time since. A decision therefore costs O(batch of R + batch of V).
2. For victims V in decreasing T_V (at most three): the movable sequences of V (not pinned,
   moved fewer than `max_moves_per_seq` times, last moved over `min_move_interval_s` ago, with
   enough expected work left to repay a re-prefill) in decreasing expected remaining work.
   Moving the k longest shortens V (T_V(k) falls with k) and lengthens R (T_R(k) rises with k):
   binary-search the k that minimises max(T_V(k), T_R(k) + re-prefill), and move them if that
   beats T_V by max(`min_gain_s`, `min_gain_frac` x T_V). The longest-expected work lands on the lightly loaded replica, so
   the tail decodes at small-batch speed.
"""
from __future__ import annotations

import numpy as np

from ..config import PolicyConfig
from ..engines.cost_model import CostModel
from ..state import ClusterView, ReplicaState, SeqStatus
from .base import Assign, Decision, GiveUp, Policy
from .estimate import TYPICAL_LENGTH_FLOOR, expected_remaining, finish_time_of
from .pull import fair_take, take_for, take_spread

MIGRATION_OVERHEAD_S = 0.1  # abort + report + dispatch: about two pull intervals
VICTIMS_PER_DECISION = 1
STEAL_INTERVAL_S = 0.5  # per-replica rate limit on estimates and steal attempts: bounds router CPU
REPAY_FACTOR = 20.0  # a move needs expected decode time left >= this x its re-prefill time


class Load:
    """The sequences of one replica as arrays: expected remaining tokens, context, the seqs."""

    __slots__ = ("rem", "ctx", "seqs")

    def __init__(self, rem, ctx, seqs):
        self.rem, self.ctx, self.seqs = rem, ctx, seqs

    def without(self, idx, arrays_only: bool = False) -> "Load":
        keep = np.ones(len(self.rem), dtype=bool)
        keep[list(idx)] = False
        seqs = None if arrays_only else [s for s, k in zip(self.seqs, keep) if k]
        return Load(self.rem[keep], self.ctx[keep], seqs)

    def plus(self, other: "Load", idx, arrays_only: bool = False) -> "Load":
        idx = list(idx)
        seqs = None if arrays_only else self.seqs + [other.seqs[i] for i in idx]
        return Load(np.concatenate((self.rem, other.rem[idx])), np.concatenate((self.ctx, other.ctx[idx])), seqs)


class StealPolicy(Policy):
    name = "steal"

    def __init__(self, cfg: PolicyConfig, cost: CostModel):
        self.cfg = cfg
        self.cost = cost
        self.finish_estimate: dict = {}  # replica_id -> (time of estimate, seconds left then)
        self.last_attempt: dict = {}
        self.moves = 0
        self.pending_reprefill = 0.0  # ordered but not yet counted by the router (decays as it counts)
        self._counted = 0

    # --- estimates -------------------------------------------------------------------
    def _typical(self, view: ClusterView) -> float:
        recent = view.finished_lengths[-512:]
        if len(recent) < 8:
            return float(TYPICAL_LENGTH_FLOOR)
        return float(max(TYPICAL_LENGTH_FLOOR, sorted(recent)[len(recent) // 2]))

    def _load(self, view: ClusterView, seqs: list, typical: float) -> Load:
        n = len(seqs)
        ctx = np.fromiter((s.context_tokens for s in seqs), dtype=np.float64, count=n)
        if self.cfg.tail_isolation:
            groups = view.groups
            rem = np.fromiter((expected_remaining(s, groups.get(s.group), typical) for s in seqs),
                              dtype=np.float64, count=n)
        else:  # expected_remaining without group information, vectorised (the hot path)
            g = np.fromiter((s.generated for s in seqs), dtype=np.float64, count=n)
            cap = np.fromiter((s.max_tokens for s in seqs), dtype=np.float64, count=n)
            rem = np.maximum(1.0, np.minimum(cap - g, np.maximum(2.0 * g, typical) - g))
        return Load(rem, ctx, seqs)

    def _scale(self, rep: ReplicaState) -> float:
        """Measured / modelled step time: corrects the profile for this replica's hardware."""
        st = rep.stats
        predicted = self.cost.step_s(st.running, st.context_tokens)
        if st.step_time_s <= 0 or predicted <= 0:
            return 1.0
        return min(4.0, max(0.25, st.step_time_s / predicted))

    def _finish(self, load: Load, scale: float) -> float:
        return finish_time_of(load.rem, load.ctx, self.cost, scale)

    def _left(self, rid: str, now: float) -> float:
        t0, est = self.finish_estimate.get(rid, (now, 0.0))
        return est - (now - t0)

    # --- decision --------------------------------------------------------------------
    def decide(self, view: ClusterView, replica_id: str) -> Decision:
        rep = view.replicas[replica_id]
        take = take_spread if self.cfg.spread_groups else take_for
        starts = take(view, replica_id, fair_take(view, replica_id))
        decision = Decision(assign=[Assign(s, replica_id) for s in starts])
        now = view.now
        # Orders become the router's count once partials arrive; stop counting them twice.
        self.pending_reprefill = max(0.0, self.pending_reprefill - (view.reprefill_tokens - self._counted))
        self._counted = view.reprefill_tokens
        if now - self.last_attempt.get(replica_id, float("-inf")) < STEAL_INTERVAL_S:
            return decision
        self.last_attempt[replica_id] = now
        typical = self._typical(view)
        mine = self._load(view, list(rep.seqs.values()) + starts, typical)
        scale_r = self._scale(rep)
        t_r = self._finish(mine, scale_r)
        self.finish_estimate[replica_id] = (now, t_r)
        free = rep.capacity - rep.load - len(starts)
        if len(view.queue) > len(starts) or free <= 0 or self.cfg.max_moves_per_seq == 0:
            return decision
        budget = min(free, self.cfg.max_moves_per_decision)
        # Migrations are an investment paid in re-prefill: keep it within a fraction of the work done.
        allowance = self.cfg.max_reprefill_frac * view.generated_tokens - view.reprefill_tokens - self.pending_reprefill
        if allowance <= 0:
            return decision
        victims = sorted((rid for rid in view.replicas if rid != replica_id), key=lambda r: -self._left(r, now))
        for vid in victims[:VICTIMS_PER_DECISION]:
            if budget <= 0 or self._left(vid, now) <= t_r + self._min_gain(self._left(vid, now)):
                break
            victim = view.replicas[vid]
            scale_v = self._scale(victim)
            theirs = self._load(view, [s for s in victim.seqs.values() if s.status is SeqStatus.RUNNING], typical)
            t_v = self._finish(theirs, scale_v)
            self.finish_estimate[vid] = (now, t_v)
            movable = self._within(self._movable(theirs, now, scale_v), theirs, allowance)
            if not movable:
                continue
            # Two ways to shorten V: hand its longest work to R (R finishes sooner anyway), or
            # shed the rest of V's batch to R so V's critical sequence decodes at a smaller batch.
            critical = int(np.argmax(theirs.rem))
            best = (0, t_v, [])
            for cand in (movable[:budget], [i for i in movable if i != critical][:budget]):
                k, t_after = self._best_k(theirs, cand, mine, scale_v, scale_r)
                if k and t_after < best[1]:
                    best = (k, t_after, cand[:k])
            k, t_after, moved = best
            if k == 0 or t_after + self._min_gain(t_v) >= t_v:
                continue
            decision.give_up += [GiveUp(theirs.seqs[i], destination=replica_id) for i in moved]
            cost = float(theirs.ctx[moved].sum())
            allowance -= cost
            self.pending_reprefill += cost
            mine = mine.plus(theirs, moved)
            self.finish_estimate[vid] = (now, self._finish(theirs.without(moved), scale_v))
            t_r = t_after
            budget -= k
            self.moves += k
        self.finish_estimate[replica_id] = (now, t_r)
        return decision

    def _within(self, movable: list, load: Load, allowance: float) -> list:
        """The prefix of `movable` whose re-prefill fits the allowance."""
        out, spent = [], 0.0
        for i in movable:
            spent += load.ctx[i]
            if spent > allowance:
                break
            out.append(i)
        return out

    def _min_gain(self, t_v: float) -> float:
        return max(self.cfg.min_gain_s, self.cfg.min_gain_frac * t_v)

    def _movable(self, load: Load, now: float, scale: float) -> list:
        """Indices of sequences that may move and repay their re-prefill, longest work first."""
        cfg = self.cfg
        step = self.cost.step_s(1, 0) * scale
        out = [i for i, s in enumerate(load.seqs)
               if s.migratable and s.moves < cfg.max_moves_per_seq and now - s.last_move_t >= cfg.min_move_interval_s
               and load.rem[i] * step >= REPAY_FACTOR * (self.cost.prefill_s(load.ctx[i]) + MIGRATION_OVERHEAD_S)]
        out.sort(key=lambda i: -load.rem[i])
        return out

    def _best_k(self, theirs: Load, cand: list, mine: Load, scale_v: float, scale_r: float) -> tuple:
        """The k in [0, len(cand)] minimising the later of the two finishes if V's candidates
        cand[:k] move to R, by binary search on the crossing of T_V(k) (falling) and T_R(k)
        (rising). Returns (k, that finish)."""
        def finishes(k):
            moved = cand[:k]
            reprefill = (float(theirs.ctx[moved].sum()) / self.cost.prefill_tokens_per_s * scale_r
                         + MIGRATION_OVERHEAD_S) if k else 0.0
            return (self._finish(theirs.without(moved, True), scale_v),
                    self._finish(mine.plus(theirs, moved, True), scale_r) + reprefill)

        lo, hi = 0, len(cand)
        while lo < hi:  # smallest k with T_R(k) >= T_V(k)
            mid = (lo + hi) // 2
            t_v, t_r = finishes(mid)
            if t_r >= t_v:
                hi = mid
            else:
                lo = mid + 1
        best = (0, max(finishes(0)))
        for k in sorted({max(1, lo - 1), lo}):
            if 0 < k <= len(cand):
                t = max(finishes(k))
                if t < best[1]:
                    best = (k, t)
        return best

    def on_replica_removed(self, replica_id: str) -> None:
        self.finish_estimate.pop(replica_id, None)
