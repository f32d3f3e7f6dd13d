"""WorkQueue's bookkeeping: its length (asked at every pull) and its lanes stay exact through
random pushes, removals, re-reservations and released lanes."""
import random

from rollout_cluster.router.state import SeqState, WorkQueue
from rollout_cluster.protocol import SamplingSpec, SequenceRequest


def _seq(i: int, generated: int = 0) -> SeqState:
    req = SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=8), i // 4, i % 4)
    return SeqState(seq_id=f"s{i}", batch_id="b", index=i, group=("b", i // 4), request=req,
                    submitted_t=0.0, generated=generated)


def _members(q: WorkQueue) -> list:
    return (list(q.fresh) + list(q.continuations)
            + [sid for lane in q.reserved.values() for sid in lane])


def test_length_and_lanes_stay_exact_through_random_operations():
    rng = random.Random(7)
    q = WorkQueue()
    seqs = [_seq(i, generated=rng.choice((0, 5))) for i in range(200)]
    inside: set = set()
    for _ in range(5000):
        op = rng.random()
        s = rng.choice(seqs)
        if op < 0.4 and s.seq_id not in inside:
            q.push(s, reserved_for=rng.choice((None, "r0", "r1", "r2")) if s.generated else None)
            inside.add(s.seq_id)
        elif op < 0.5 and s.seq_id in q._reserved_for:
            q.push(s, reserved_for=rng.choice(("r0", "r1", "r2")))  # re-reserved elsewhere
        elif op < 0.9:
            q.remove(s)
            inside.discard(s.seq_id)
        else:
            q.release_reserved(rng.choice(("r0", "r1", "r2")))
        members = _members(q)
        assert len(members) == len(set(members)) == len(q) == len(inside)
        assert set(members) == inside
        assert all(q.reserved.values()), "an emptied lane is dropped"
    assert sum(len(g) for g in q.fresh_by_group.values()) == len(q.fresh)
