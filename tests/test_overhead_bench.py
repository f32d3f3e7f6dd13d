"""The overhead bench's arithmetic (bench/overhead.py): paired percentages, the control engine's
summary and the table, from pairs as the bench prints them (no engine needed)."""
from types import SimpleNamespace

from rollout_cluster.bench.overhead import combine, control_stats, pct_over, table
from rollout_cluster.bench.repeats import round_order


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
CFG = SimpleNamespace(engine=SimpleNamespace(model="m", max_num_seqs=8, max_num_batched_tokens=64))


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
