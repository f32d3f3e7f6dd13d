"""The overhead bench's arithmetic (bench/overhead.py): paired percentages, the control engine's
summary and the table, from pairs as the bench prints them (no engine needed)."""
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rollout_cluster.bench.overhead import combine, control_stats, merge_runs, pct_over, split_by_prompt, table
from rollout_cluster.bench.repeats import only_pairs, round_order


def run(makespan: float, median: float = 10.0) -> dict:
    return {"makespan_s": makespan, "median_finish_s": median, "tail_s": 1.0, "tokens": 100}


def pair(seed: int, r: int, cluster: float, bare: float, control: float | None = None) -> dict:
    p = {"seed": seed, "round": r, "order": ["cluster", "bare"], "cluster": run(cluster), "bare": run(bare),
         "overhead_pct": pct_over(run(cluster), run(bare))}
    if control is not None:
        p["control"], p["control_pct"] = run(control), pct_over(run(control), run(bare))
        p["order"].append("control")
    return p


ARGS = SimpleNamespace(config="c.yaml", memory_fraction=0.28, rounds=2, prompts=4, samples=2, median=10,
                       sigma_prompt=0.5, sigma_sample=0.5, max_tokens=64, prompt_min=4, prompt_max=8)
CFG = SimpleNamespace(engine=SimpleNamespace(model="m", max_num_seqs=8, max_num_batched_tokens=64), replicas=1,
                      policy=SimpleNamespace(name="pull"))


def test_pct_over_is_how_much_longer_the_run_took():
    assert pct_over(run(52.0), run(50.0)) == 4.0
    assert pct_over(run(45.0), run(50.0)) == -10.0


def test_the_control_is_summarized_against_the_first_bare_engine():
    pairs = [pair(0, 0, 52.0, 50.0, 46.0), pair(0, 1, 50.0, 50.0, 51.0), pair(1, 0, 40.0, 41.0, 41.0)]
    # the cluster against the mean of both bare engines: 52/48, 50/50.5, 40/41
    assert control_stats(pairs) == {"control_median_pct": 0.0, "control_min_pct": -8.0, "control_max_pct": 2.0,
                                    "vs_both_median_pct": -0.99, "vs_both_min_pct": -2.44, "vs_both_max_pct": 8.33}
    result = combine(pairs, CFG, ARGS)
    assert result["median_overhead_pct"] == 0.0 and result["max_pct"] == 4.0
    assert result["per_seed_median_pct"] == {0: 2.0, 1: -2.44}
    text = table(result)
    assert "| 46.00 | -8.00 % |" in text and "control (a second bare engine, started last)" in text
    assert "spread -8.00 to +2.00 %" in text
    assert "mean of both bare engines, round by round: median -0.99 % (spread -2.44 to +8.33 %)" in text


def test_without_a_control_there_is_no_control_column():
    result = combine([pair(0, 0, 52.0, 50.0)], CFG, ARGS)
    assert "control_median_pct" not in result
    assert "control" not in table(result)


def test_every_engine_leads_a_round_in_turn():
    names = ["cluster", "bare", "control"]
    firsts = [round_order(names, k)[0] for k in range(3)]
    assert sorted(firsts) == sorted(names)


def requests(samples_per_prompt: list) -> list:
    return [SimpleNamespace(prompt_index=p, sample_index=j) for p, n in enumerate(samples_per_prompt) for j in range(n)]


@given(st.lists(st.integers(1, 5), max_size=40), st.integers(1, 6))
def test_bare_engines_split_a_batch_by_contiguous_prompt_shares(samples, engines):
    reqs = requests(samples)
    shares = split_by_prompt(reqs, engines)
    assert len(shares) == engines
    assert sorted(id(r) for share in shares for r in share) == sorted(id(r) for r in reqs)  # each request once
    prompts = [sorted({r.prompt_index for r in share}) for share in shares]
    flat = [p for ps in prompts for p in ps]
    assert flat == list(range(len(samples)))  # contiguous, in order, no prompt on two engines
    counts = [len(ps) for ps in prompts]
    assert max(counts) - min(counts) <= 1


def test_two_engines_take_half_the_prompts_each_with_all_their_samples():
    shares = split_by_prompt(requests([2, 3, 1, 2]), 2)
    assert [[(r.prompt_index, r.sample_index) for r in s] for s in shares] == [
        [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)], [(2, 0), (3, 0), (3, 1)]]


def test_bare_engines_run_together_end_with_the_slowest():
    merged = merge_runs([{"makespan_s": 40.0, "tokens": 10, "finish_times": [1.0, 40.0]},
                         {"makespan_s": 55.5, "tokens": 7, "finish_times": [55.5]}])
    assert merged == {"makespan_s": 55.5, "tokens": 17, "finish_times": [1.0, 40.0, 55.5]}


def test_combine_records_the_cluster_shape():
    cfg = SimpleNamespace(**{**vars(CFG), "replicas": 2, "policy": SimpleNamespace(name="steal")})
    result = combine([pair(0, 0, 52.0, 50.0)], cfg, ARGS)
    assert (result["replicas"], result["policy"]) == (2, "steal")
    assert "the cluster: 2 replicas, policy steal; bare: 2 engines" in table(result)
    assert "the cluster:" not in table(combine([pair(0, 0, 52.0, 50.0)], CFG, ARGS))


def test_only_pairs_reads_seed_round_pairs_and_names_a_bad_one():
    assert only_pairs(None, [0, 1], 2) is None
    assert only_pairs("0:1, 2:1", [0, 2], 2) == {(0, 1), (2, 1)}
    with pytest.raises(ValueError, match="'3:0'.*--seeds 0,2"):
        only_pairs("3:0", [0, 2], 2)  # a seed that is not run
    with pytest.raises(ValueError, match="'0:2'.*--rounds 2"):
        only_pairs("0:2", [0, 2], 2)  # a round past --rounds
    with pytest.raises(ValueError, match="'0-1': each pair is SEED:ROUND"):
        only_pairs("0-1", [0], 2)
