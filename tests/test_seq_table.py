"""SeqTable: the per-replica columns the steal policy reads must always describe the SeqStates
the router holds, through every join, leave, progress report and give-up."""
import random
from types import SimpleNamespace

import numpy as np
import pytest

from rollout_cluster.bench.workloads import LongtailSpec, rl_longtail
from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.router.seq_table import SeqTable
from rollout_cluster.sim.simulator import Simulation
from rollout_cluster.router.state import SeqStatus


def seq(i, rng):
    return SimpleNamespace(seq_id=f"s{i}", generated=rng.randrange(0, 500), status=SeqStatus.RUNNING,
                           request=SimpleNamespace(prompt_len=rng.randrange(1, 900),
                                                   sampling=SimpleNamespace(max_tokens=rng.randrange(500, 9000))))


def expected_columns(seqs, running_only):
    chosen = [s for s in seqs if not running_only or s.status is SeqStatus.RUNNING]
    return {s.seq_id: (s.generated, s.request.prompt_len, s.request.sampling.max_tokens) for s in chosen}


def table_columns(table, running_only):
    seqs, g, p, c = table.columns(running_only)
    assert len(seqs) == len(g) == len(p) == len(c)
    return {s.seq_id: (g[i], p[i], c[i]) for i, s in enumerate(seqs)}


def check(table, ref):
    assert len(table) == len(ref) and bool(table) == bool(ref)
    assert set(table) == set(ref) and {s.seq_id for s in table.values()} == set(ref)
    for sid, s in ref.items():
        assert sid in table and table[sid] is s and table.get(sid) is s
    for running_only in (False, True):
        assert table_columns(table, running_only) == expected_columns(ref.values(), running_only)


def test_random_joins_leaves_progress_and_give_ups_keep_the_columns_exact():
    rng = random.Random(0)
    table, ref, next_id = SeqTable(), {}, 0
    for step in range(3000):
        op = rng.random()
        if op < 0.4 or not ref:  # join (past the initial 64 rows: the arrays grow)
            s = seq(next_id, rng)
            next_id += 1
            table[s.seq_id] = s
            ref[s.seq_id] = s
        elif op < 0.6:  # leave, from anywhere (the last row moves into the hole)
            sid = rng.choice(list(ref))
            if rng.random() < 0.5:
                del table[sid]
            else:
                assert table.pop(sid) is ref[sid]
            del ref[sid]
        elif op < 0.9:  # tokens reported
            s = ref[rng.choice(list(ref))]
            s.generated += rng.randrange(1, 40)
            table.progressed(s)
        else:  # told to give up
            s = ref[rng.choice(list(ref))]
            if s.status is SeqStatus.RUNNING:
                s.status = SeqStatus.GIVING_UP
                table.giving_up(s)
        if step % 50 == 0:
            check(table, ref)
    check(table, ref)
    assert next_id > 64 * 2 and table.pop("missing", "default") == "default"


def test_columns_are_copies_that_later_changes_do_not_touch():
    rng = random.Random(1)
    table = SeqTable()
    a, b = seq(0, rng), seq(1, rng)
    table[a.seq_id], table[b.seq_id] = a, b
    seqs, g, _, _ = table.columns()
    before = g.copy()
    a.generated += 100
    table.progressed(a)
    del table[b.seq_id]
    assert np.array_equal(g, before) and [s.seq_id for s in seqs] == ["s0", "s1"]


@pytest.mark.parametrize("policy", ["steal", "scripted"])
def test_router_keeps_every_replica_table_exact_through_a_batch_with_migrations(policy):
    """The router changes SeqStates in many places (dispatch, reports, give-ups, finishes, lost
    work); after every report each replica's columns must match its sequences."""
    cost = load_profile("a100-80g-7b", max_num_seqs=64)
    pc = {"scripted_at_tokens": [100, 300]} if policy == "scripted" else {}
    sim = Simulation(make_policy(PolicyConfig(name=policy, **pc), cost), cost, 6)
    core = sim.core
    on_report = core.on_report
    checked = {"reports": 0, "giving_up": 0}

    def checked_report(report, now, timer=None):
        orders = on_report(report, now, timer)
        for rep in core.fleet.replicas.values():
            seqs = list(rep.seqs.values())
            want = {s.seq_id: (s.generated, s.request.prompt_len, s.request.sampling.max_tokens) for s in seqs}
            assert table_columns(rep.seqs, False) == want
            running = {sid: v for sid, v in want.items() if rep.seqs[sid].status is SeqStatus.RUNNING}
            assert table_columns(rep.seqs, True) == running
            checked["giving_up"] += len(want) - len(running)
        checked["reports"] += 1
        return orders

    core.on_report = checked_report
    res = sim.run(rl_longtail(LongtailSpec(prompts=48, samples=8, median=1500, max_tokens=8192, seed=0)))
    assert res.counters["migrations"] > 0 and checked["giving_up"] > 0 and checked["reports"] > 100
    assert all(c is not None and c.finish_reason == "length" for c in res.completions)
