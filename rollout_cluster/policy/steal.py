"""`steal`: pull dispatch, then work-stealing once the global queue is empty.

Algorithm, at a pull by replica R with free slots and nothing queued (rate-limited per replica):
1. Estimate R's finish time T_R; every other replica's estimate is the one made at its own
   latest attempt, aged by the time since. An attempt costs O(batch of R + batch of V) numpy
   work (estimate.finish_time_of is O(n), without a sort) and O(moves) Python work.
2. For the victim V with the latest T_V: the movable sequences of V (not pinned,
   moved fewer than `max_moves_per_seq` times, last moved over `min_move_interval_s` ago, with
   enough expected work left to repay a re-prefill) in decreasing expected remaining work.
   Moving the k longest shortens V (T_V(k) falls with k) and lengthens R (T_R(k) rises with k):
   evaluate every k (a running sum and max, `_best_k`) and take the one minimising
   max(T_V(k), T_R(k) + re-prefill); move them if that beats T_V by max(`min_gain_s`,
   `min_gain_frac` x T_V). The longest-expected work lands on the lightly loaded replica, so
   the tail decodes at small-batch speed.
"""
from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import Field

from ..engines.cost_model import CostModel
from ..router.state import ClusterView, ReplicaState, SeqStatus
from .base import Assign, Decision, GiveUp, Policy, PolicySettings
from .estimate import TYPICAL_LENGTH_FLOOR, expected_remaining_array, own_costs
from .pull import fair_take, take_for, take_spread

MIGRATION_OVERHEAD_S = 0.1  # abort + report + dispatch: about two pull intervals
STEAL_INTERVAL_S = 0.5  # per-replica rate limit on estimates and steal attempts: bounds router CPU
FULL_REFRESH_S = 2.0  # the same for a replica with no free slot (it can only be a victim)
REPAY_FACTOR = 20.0  # a move needs expected decode time left >= this x its re-prefill time


class StealConfig(PolicySettings):
    name: Literal["steal"] = "steal"
    min_move_interval_s: float = Field(2.0, ge=0, description="no sequence moves twice within this")
    max_moves_per_seq: int = Field(3, ge=0, description="cap on moves of one sequence (0: steal behaves like pull)")
    min_gain_s: float = Field(0.5, ge=0, description="a move must shorten the victim's predicted finish by this...")
    min_gain_frac: float = Field(0.06, ge=0, lt=1, description=(
        "...and by this fraction of it (scale-free: CPU seconds, GPU minutes)"))
    max_moves_per_decision: int = Field(32, ge=1, description="cap on sequences moved by one decision")
    max_reprefill_frac: float = Field(0.10, ge=0, le=1, description=(
        "re-prefilled tokens stay below this fraction of generated tokens"))
    spread_groups: bool = Field(True, description=(
        "place a group's samples on different replicas (their lengths correlate)"))
    spread_chunk: int = Field(2, ge=1, description=(
        "spreading: a group's samples go to a replica this many at a time (fewer prompt prefills)"))
    tail_isolation: bool = Field(False, description=(
        "estimate remaining work from group siblings (measured: experiments/isolation-headroom)"))


class Load:
    """The sequences of one replica as arrays (expected remaining tokens, context, the seqs),
    with what the finish-time estimate needs: each sequence's own cost, their sum, the longest."""

    __slots__ = ("rem", "ctx", "seqs", "own", "total", "longest")

    def __init__(self, rem, ctx, seqs, cost: CostModel):
        self.rem, self.ctx, self.seqs = rem, ctx, seqs
        self.own = own_costs(rem, ctx, cost)
        self.total = float(self.own.sum())
        self.longest = float(rem.max()) if len(rem) else 0.0

    def finish(self, cost: CostModel, scale: float) -> float:
        """estimate.finish_time_of, from the cached sums."""
        return (cost.a * self.longest + self.total) * scale if len(self.rem) else 0.0



class StealPolicy(Policy):
    name = "steal"

    def __init__(self, cfg: StealConfig, cost: CostModel):
        self.cfg = cfg
        self.cost = cost
        # replica_id -> when its latest estimate expects it to finish (absolute time: the
        # estimate ages without being touched, and the latest finisher is a plain max)
        self.finish_at: dict = {}
        self.last_attempt: dict = {}
        self.moves = 0
        # thief -> {seq_id: its context when ordered}: the give-ups ordered to it whose sequence is
        # still on its victim (GIVING_UP). They hold a slot of the thief (its next attempt must not
        # book it again) and re-prefill the router has not counted yet; once handed back (reserved
        # for the thief, running there) or ended where it was (a natural finish won the race), not.
        self.inbound: dict[str, dict[str, float]] = {}
        self._typical_t, self._typical_value = float("-inf"), float(TYPICAL_LENGTH_FLOOR)

    # --- estimates -------------------------------------------------------------------
    def _typical(self, view: ClusterView) -> float:
        """Median length of recently finished sequences, refreshed once a steal interval."""
        if view.now - self._typical_t >= STEAL_INTERVAL_S or view.now < self._typical_t:
            window = view.finished_lengths[-512:]
            median = float(np.median(window)) if len(window) >= 8 else 0.0
            self._typical_t, self._typical_value = view.now, max(float(TYPICAL_LENGTH_FLOOR), median)
        return self._typical_value

    def _load(self, view: ClusterView, rep: ReplicaState, typical: float, starts: list = (),
              running_only: bool = False) -> Load:
        """The Load of `rep`'s sequences (plus `starts`, about to join it), from the columns the
        router keeps up to date (SeqTable): O(batch) numpy work, O(len(starts)) Python work."""
        seqs, g, prompt, cap = rep.seqs.columns(running_only)
        if starts:
            seqs = seqs + list(starts)
            g = np.concatenate((g, [s.generated for s in starts]))
            prompt = np.concatenate((prompt, [s.request.prompt_len for s in starts]))
            cap = np.concatenate((cap, [s.request.sampling.max_tokens for s in starts]))
        if not seqs:
            return Load(np.zeros(0), np.zeros(0), seqs, self.cost)
        ctx = g + prompt
        if self.cfg.tail_isolation:
            groups = view.groups
            sizes, finished = [], []
            for s in seqs:
                grp = groups.get(s.group)
                sizes.append(grp.size if grp is not None else 1)
                finished.append(grp.finished if grp is not None else 0)
            rem = expected_remaining_array(g, cap, np.array(sizes, dtype=np.float64),
                                           np.array(finished, dtype=np.float64), typical)
        else:  # expected_remaining without group information, vectorised
            rem = np.maximum(1.0, np.minimum(cap - g, np.maximum(2.0 * g, typical) - g))
        return Load(rem, ctx, seqs, self.cost)

    def _scale(self, rep: ReplicaState) -> float:
        """Measured / modelled step time: corrects the profile for this replica's hardware."""
        st = rep.stats
        predicted = self.cost.step_s(st.running, st.context_tokens)
        if st.step_time_s <= 0 or predicted <= 0:
            return 1.0
        return min(4.0, max(0.25, st.step_time_s / predicted))

    def _finish(self, load: Load, scale: float) -> float:
        return load.finish(self.cost, scale)

    def _latest_other(self, view: ClusterView, replica_id: str):
        """(replica, its finish time) of the replica other than `replica_id` expected to finish
        last, among those in the view; (None, -inf) if none has an estimate."""
        best, best_t = None, float("-inf")
        replicas = view.replicas
        for rid, t in self.finish_at.items():
            if t > best_t and rid != replica_id and rid in replicas:
                best, best_t = rid, t
        return best, best_t

    # --- decision --------------------------------------------------------------------
    def decide(self, view: ClusterView, replica_id: str) -> Decision:
        rep = view.replicas[replica_id]
        limit = fair_take(view, replica_id)
        if self.cfg.spread_groups:
            starts = take_spread(view, replica_id, limit, self.cfg.spread_chunk)
        else:
            starts = take_for(view, replica_id, limit)
        decision = Decision(assign=[Assign(s, replica_id) for s in starts])
        now = view.now
        coming = self._coming(view)
        mine_coming = [view.seqs[sid] for sid in self.inbound.get(replica_id, ())]
        last = self.last_attempt.get(replica_id, float("-inf"))
        full = rep.capacity - rep.load - len(starts) - len(mine_coming) <= 0
        # A full replica cannot take work: it only refreshes its own estimate (for thieves to
        # rank it as a victim), and less often; thieves re-estimate the victim they pick anyway.
        if now - last < (FULL_REFRESH_S if full else STEAL_INTERVAL_S):
            return decision
        self.last_attempt[replica_id] = now
        typical = self._typical(view)
        mine = self._load(view, rep, typical, list(starts) + mine_coming)
        scale_r = self._scale(rep)
        t_r = self._finish(mine, scale_r)
        self.finish_at[replica_id] = now + t_r
        free = rep.capacity - rep.load - len(starts) - len(mine_coming)
        if len(view.queue) > len(starts) or free <= 0 or self.cfg.max_moves_per_seq == 0:
            return decision
        budget = min(free, self.cfg.max_moves_per_decision)
        # Migrations are an investment paid in re-prefill: keep it within a fraction of the work done.
        allowance = self.cfg.max_reprefill_frac * view.generated_tokens - view.reprefill_tokens - coming
        if allowance <= 0:
            return decision
        # One victim per attempt: the replica expected to finish last.
        vid, vid_at = self._latest_other(view, replica_id)
        if vid is None or vid_at - now <= t_r + self._min_gain(vid_at - now):
            return decision
        victim = view.replicas[vid]
        scale_v = self._scale(victim)
        theirs = self._load(view, victim, typical, running_only=True)
        t_v = self._finish(theirs, scale_v)
        self.finish_at[vid] = now + t_v
        movable = self._within(self._movable(theirs, now, scale_v, budget + 1), theirs, allowance)
        if not movable:
            return decision
        # Two ways to shorten V: hand its longest work to R (R finishes sooner anyway), or
        # shed the rest of V's batch to R so V's critical sequence decodes at a smaller batch.
        critical = int(np.argmax(theirs.rem))
        best = (0, t_v, [], t_v, t_r)
        whole = movable[:budget]
        shed = [i for i in movable if i != critical][:budget]
        for cand in (whole, shed) if shed != whole else (whole,):
            k, t_after, t_v_after, t_r_after = self._best_k(theirs, cand, mine, scale_v, scale_r)
            if k and t_after < best[1]:
                best = (k, t_after, cand[:k], t_v_after, t_r_after)
        k, t_after, moved, t_v_after, t_r_after = best
        if k == 0 or t_after + self._min_gain(t_v) >= t_v:
            return decision
        decision.give_up += [GiveUp(theirs.seqs[i], destination=replica_id) for i in moved]
        self.inbound.setdefault(replica_id, {}).update((theirs.seqs[i].seq_id, float(theirs.ctx[i])) for i in moved)
        self.finish_at[vid] = now + t_v_after
        self.finish_at[replica_id] = now + t_r_after  # R's own finish: t_after is the later of the two
        self.moves += k
        return decision

    def _coming(self, view: ClusterView) -> float:
        """Forget the give-ups no longer on their way (handed back, ended, requeued: see `inbound`);
        returns the re-prefill of those still coming, which the router has not counted yet.
        O(give-ups in flight)."""
        seqs, total = view.seqs, 0.0
        for rid in list(self.inbound):
            coming = self.inbound[rid]
            for sid in [sid for sid in coming
                        if (s := seqs.get(sid)) is None or s.status is not SeqStatus.GIVING_UP]:
                del coming[sid]
            if coming:
                total += sum(coming.values())
            else:
                del self.inbound[rid]
        return total

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

    def _movable(self, load: Load, now: float, scale: float, limit: int) -> list:
        """Indices of up to `limit` sequences that may move and repay their re-prefill, longest
        work first. The repay rule is vectorised; the per-sequence rules run only on the few
        longest, so an attempt costs O(batch) numpy work and O(limit) Python work."""
        cfg = self.cfg
        step = self.cost.step_s(1, 0) * scale
        repays = load.rem * step >= REPAY_FACTOR * (load.ctx / self.cost.prefill_tokens_per_s + MIGRATION_OVERHEAD_S)
        out = []
        for i in np.flatnonzero(repays)[np.argsort(-load.rem[repays], kind="stable")]:
            s = load.seqs[i]
            if s.migratable and s.moves < cfg.max_moves_per_seq and now - s.last_move_t >= cfg.min_move_interval_s:
                out.append(int(i))
                if len(out) >= limit:
                    break
        return out

    def _best_k(self, theirs: Load, cand: list, mine: Load, scale_v: float, scale_r: float) -> tuple:
        """The k in [0, len(cand)] minimising the later of the two finishes if V's candidates
        cand[:k] move to R (R pays their re-prefill). With the additive cost (finish_time_of),
        moving cand[:k] takes their own costs off V and onto R, and changes only the longest
        work left on each side: a running sum and a running max over k, O(len(cand)) after one
        O(batch) max. Returns (k, that finish, V's and R's finishes after the move)."""
        a, prefill = self.cost.a, self.cost.prefill_tokens_per_s
        staying = np.ones(len(theirs.rem), dtype=bool)
        staying[cand] = False
        rest_max = float(theirs.rem[staying].max()) if staying.any() else 0.0
        rem_c, own_c, ctx_c = theirs.rem[cand].tolist(), theirs.own[cand].tolist(), theirs.ctx[cand].tolist()
        left_max = [rest_max] * (len(cand) + 1)  # longest left on V once cand[:k] are gone
        for k in range(len(cand) - 1, -1, -1):
            left_max[k] = max(left_max[k + 1], rem_c[k])
        t_v0 = theirs.finish(self.cost, scale_v)
        t_r0 = mine.finish(self.cost, scale_r)
        best_k, best_t, best_v, best_r = 0, max(t_v0, t_r0), t_v0, t_r0
        moved_own = moved_ctx = 0.0
        got_max = mine.longest
        for k in range(1, len(cand) + 1):
            moved_own += own_c[k - 1]
            moved_ctx += ctx_c[k - 1]
            got_max = max(got_max, rem_c[k - 1])
            t_v = (a * left_max[k] + theirs.total - moved_own) * scale_v if left_max[k] > 0 else 0.0
            t_r = ((a * got_max + mine.total + moved_own) * scale_r
                   + moved_ctx / prefill * scale_r + MIGRATION_OVERHEAD_S)
            if max(t_v, t_r) < best_t:
                best_k, best_t, best_v, best_r = k, max(t_v, t_r), t_v, t_r
        return best_k, best_t, best_v, best_r

    def on_replica_removed(self, replica_id: str) -> None:
        self.finish_at.pop(replica_id, None)
        self.last_attempt.pop(replica_id, None)
        self.inbound.pop(replica_id, None)
