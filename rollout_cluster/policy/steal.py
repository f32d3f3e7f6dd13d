"""`steal`: pull dispatch, then work-stealing once the global queue is empty.

Algorithm, at a pull by replica R with free slots and nothing queued:
1. Estimate R's finish time T_R and use the latest estimate of every other replica (each is
   refreshed when that replica pulls, so a decision costs O(batch of R + batch of victim)).
2. Take victims V in decreasing T_V. From V, consider movable sequences (not pinned, moved
   fewer than `max_moves_per_seq` times, not within `min_move_interval_s` of their last move)
   in decreasing expected remaining work. Move one if, with it moved, max(T_V', T_R' + re-prefill)
   plus `min_gain_s` is still below T_V. The longest-expected work lands on the lightly loaded
   replica, so the tail decodes at small-batch speed.
3. Stop at `max_moves_per_decision`, when R has no free slot left, or when nothing gains.
"""
from __future__ import annotations

from ..config import PolicyConfig
from ..engines.cost_model import CostModel
from ..state import ClusterView, ReplicaState, SeqStatus
from .base import Assign, Decision, GiveUp, Policy
from .estimate import TYPICAL_LENGTH_FLOOR, expected_remaining, finish_time
from .pull import fair_take, take_for

MIGRATION_OVERHEAD_S = 0.1  # abort + report + dispatch: about two pull intervals
VICTIMS_PER_DECISION = 3
STEAL_INTERVAL_S = 0.2  # per-replica rate limit on steal attempts; bounds decision cost


class StealPolicy(Policy):
    name = "steal"

    def __init__(self, cfg: PolicyConfig, cost: CostModel):
        self.cfg = cfg
        self.cost = cost
        self.finish_estimate: dict = {}  # replica_id -> (time of estimate, seconds left then)
        self.last_attempt: dict = {}
        self.moves = 0

    # --- estimates -------------------------------------------------------------------
    def _typical(self, view: ClusterView) -> float:
        f = view.finished_lengths
        if len(f) < 8:
            return float(TYPICAL_LENGTH_FLOOR)
        return float(max(TYPICAL_LENGTH_FLOOR, sorted(f[-512:])[len(f[-512:]) // 2]))

    def _remaining(self, view: ClusterView, seqs, typical: float) -> list:
        use_group = self.cfg.tail_isolation
        return [(expected_remaining(s, view.groups.get(s.group), typical, use_group), s.context_tokens, s)
                for s in seqs]

    def _scale(self, rep: ReplicaState) -> float:
        """Measured / modelled step time: corrects the profile for this replica's hardware."""
        st = rep.stats
        predicted = self.cost.step_s(st.running, st.context_tokens)
        if st.step_time_s <= 0 or predicted <= 0:
            return 1.0
        return min(4.0, max(0.25, st.step_time_s / predicted))

    def _finish(self, items: list, scale: float) -> float:
        return finish_time([(r, c) for r, c, _ in items], self.cost, scale)

    # --- decision --------------------------------------------------------------------
    def decide(self, view: ClusterView, replica_id: str) -> Decision:
        rep = view.replicas[replica_id]
        starts = take_for(view, replica_id, fair_take(view, replica_id))
        decision = Decision(assign=[Assign(s, replica_id) for s in starts])
        typical = self._typical(view)
        mine = self._remaining(view, list(rep.seqs.values()) + starts, typical)
        scale_r = self._scale(rep)
        t_r = self._finish(mine, scale_r)
        self.finish_estimate[replica_id] = (view.now, t_r)
        free = rep.capacity - rep.load - len(starts)
        if len(view.queue) > len(starts) or free <= 0 or self.cfg.max_moves_per_seq == 0:
            return decision
        if view.now - self.last_attempt.get(replica_id, float("-inf")) < STEAL_INTERVAL_S:
            return decision
        self.last_attempt[replica_id] = view.now

        def left(rid):
            t0, est = self.finish_estimate.get(rid, (view.now, 0.0))
            return est - (view.now - t0)

        victims = sorted((rid for rid in view.replicas if rid != replica_id), key=left, reverse=True)
        budget = min(free, self.cfg.max_moves_per_decision)
        for vid in victims[:VICTIMS_PER_DECISION]:
            if budget <= 0 or left(vid) <= t_r + self.cfg.min_gain_s:
                break
            victim = view.replicas[vid]
            scale_v = self._scale(victim)
            theirs = self._remaining(view, [s for s in victim.seqs.values() if s.status is SeqStatus.RUNNING], typical)
            t_v = self._finish(theirs, scale_v)
            movable = sorted((it for it in theirs if self._movable(it[2], view.now)), key=lambda it: -it[0])
            moved_any = False
            for item in movable:
                if budget <= 0:
                    break
                rest = [it for it in theirs if it[2] is not item[2]]
                t_v_new = self._finish(rest, scale_v)
                seq = item[2]
                reprefill = self.cost.prefill_s(seq.context_tokens) * scale_r + MIGRATION_OVERHEAD_S
                t_r_new = self._finish(mine + [item], scale_r) + reprefill
                if max(t_v_new, t_r_new) + self.cfg.min_gain_s >= t_v:
                    continue
                decision.give_up.append(GiveUp(seq, destination=replica_id))
                theirs, mine, t_v, t_r = rest, mine + [item], t_v_new, t_r_new
                budget -= 1
                moved_any = True
                self.moves += 1
            if moved_any:
                self.finish_estimate[vid] = (view.now, t_v)
        self.finish_estimate[replica_id] = (view.now, t_r)
        return decision

    def _movable(self, seq, now: float) -> bool:
        return (seq.migratable and seq.moves < self.cfg.max_moves_per_seq
                and now - seq.last_move_t >= self.cfg.min_move_interval_s)

    def on_replica_removed(self, replica_id: str) -> None:
        self.finish_estimate.pop(replica_id, None)
