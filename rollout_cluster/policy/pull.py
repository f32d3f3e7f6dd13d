"""`pull`: one global queue; a replica that pulls gets work up to its free slots.

Order of preference for the puller: continuations reserved for it (always taken: the policy
counted the slot when it chose this destination), then its sessions' next turns (session
affinity, router/sessions.py; another replica leaves them to it while it has free slots), then
other continuations
(work already paid for), then fresh samples of groups it already runs (prefix cache), then the
queue head. The queue is in group order, so a contiguous take keeps groups together.
"""
from __future__ import annotations

from itertools import islice
from typing import Literal

from .base import Assign, Decision, Policy, PolicySettings
from ..router.state import ClusterView


def take_for(view: ClusterView, replica_id: str, limit: int, homes: bool = True) -> list:
    """Up to `limit` queued sequences for `replica_id`, in the order described above. With
    `homes`, session affinity (router/sessions.py): the puller's own sessions' turns come right
    after its reserved work, up to its free slots whatever `limit` says, and it leaves alone the
    turns whose live home has a free slot for them (the home takes them at its next pull)."""
    q = view.queue
    out = list(q.reserved.get(replica_id, {}).values())  # slots were counted when reserved
    if homes:
        take_homed(view, replica_id, out)
    if limit <= len(out):
        return out
    skip = _skipped(view, replica_id, out) if homes else set()
    for seq in q.continuations.values():
        if seq.seq_id not in skip:
            out.append(seq)
            skip.add(seq.seq_id)
            if len(out) >= limit:
                return out
    rep = view.replicas[replica_id]
    if q.fresh and rep.seqs:
        for group in dict.fromkeys(s.group for s in rep.seqs.values()):  # (in order: a set's follows PYTHONHASHSEED)
            for seq in q.fresh_by_group.get(group, {}).values():
                if seq.seq_id not in skip:
                    out.append(seq)
                    skip.add(seq.seq_id)
                    if len(out) >= limit:
                        return out
    for seq in q.fresh.values():
        if seq.seq_id not in skip:
            out.append(seq)
            if len(out) >= limit:
                break
    return out


def take_homed(view: ClusterView, replica_id: str, out: list) -> None:
    """Add the puller's queued session turns (its home lane) to `out`, up to its free slots."""
    lane = view.queue.homed.get(replica_id)
    if lane:
        room = view.replicas[replica_id].free_slots - len(out)
        out.extend(islice(lane.values(), max(0, room)))


def _skipped(view: ClusterView, replica_id: str, out: list) -> set:
    """Queued seq ids the puller must not take: its session turns already in `out`, and turns kept
    for their session's home. (Empty without sessions: then no work is skipped.)"""
    skip = {s.seq_id for s in out if s.home is not None}
    if view.queue.homed:
        skip |= view.queue.kept_for_homes(view.replicas, replica_id)
    return skip


def take_spread(view: ClusterView, replica_id: str, limit: int, chunk: int = 1) -> list:
    """Like `take_for`, but fresh work is taken `chunk` samples per group in turn, so the samples
    of a group land on different replicas. Lengths correlate within a group: spreading a group
    spreads its (unknown) long tail instead of stacking it on one replica, at the price of the
    shared prompt's prefix-cache hits: every replica a group lands on prefills its prompt once.
    `chunk` trades the two (experiments/steal-sensitivity measures 1, 2 and 4). Session turns
    are placed as take_for places them."""
    q = view.queue
    out = take_for(view, replica_id, 0) if q.reserved.get(replica_id) or q.homed.get(replica_id) else []
    # Continuations are spread too: a pull takes them in proportion to their part of the queue. A
    # batch that resumes partial rollouts starts with hundreds of them, all long, which the first
    # replica to pull would otherwise take; requeued work alone is taken up to the limit, as before.
    share = -(-limit * len(q.continuations) // max(1, len(q.continuations) + len(q.fresh)))
    skip = _skipped(view, replica_id, out)
    for seq in islice((s for s in q.continuations.values() if s.seq_id not in skip), share):
        if len(out) >= limit:
            return out
        out.append(seq)
    skip = _skipped(view, replica_id, out)
    lanes = [iter([s for s in g.values() if s.seq_id not in skip]) if skip else iter(g.values())
             for g in q.fresh_by_group.values()]
    while lanes and len(out) < limit:
        alive = []
        for lane in lanes:
            got = list(islice(lane, min(chunk, limit - len(out))))
            if not got:
                continue
            out += got
            alive.append(lane)
            if len(out) >= limit:
                break
        lanes = alive
    return out


def fair_take(view: ClusterView, replica_id: str) -> int:
    """How much the puller may take: its free slots, but no more than its even share of all
    work (queued + running), so a small batch is not swallowed by the first replica to pull."""
    queued = len(view.queue)
    if not queued:  # (reserved continuations are taken whatever the limit)
        return 0
    rep = view.replicas[replica_id]
    total = queued + view.running
    share = -(-total // max(1, len(view.replicas)))
    return max(0, min(rep.free_slots, share - rep.load))


class PullConfig(PolicySettings):
    name: Literal["pull"] = "pull"  # no settings


class PullPolicy(Policy):
    name = "pull"

    def decide(self, view: ClusterView, replica_id: str) -> Decision:
        return Decision(assign=[Assign(s, replica_id) for s in take_for(view, replica_id, fair_take(view, replica_id))])
