"""Repeated rounds of the vLLM benchmark: order rotation, the median run, paired differences."""
import pytest

from rollout_cluster.bench.report import markdown
from rollout_cluster.bench.repeats import across_seeds, median_row, paired_pct, round_order, summarize_seed
from rollout_cluster.bench.run import combine


def test_round_order_rotates_so_each_policy_leads_once():
    pols = ["static", "pull", "steal"]
    orders = [round_order(pols, r) for r in range(3)]
    assert orders == [["static", "pull", "steal"], ["pull", "steal", "static"], ["steal", "static", "pull"]]
    assert sorted(o[0] for o in orders) == sorted(pols)
    assert round_order(pols, 4) == orders[1]


def test_median_row_picks_the_middle_run_not_the_best():
    rows = [{"makespan_s": 30.0}, {"makespan_s": 10.0}, {"makespan_s": 20.0}]
    assert median_row(rows) == 2
    assert median_row(rows[:2]) == 1  # lower median of two
    with pytest.raises(ValueError):
        median_row([])


def test_paired_pct_compares_runs_of_the_same_round():
    p = paired_pct({"steal": [99.0, 110.0, 50.0], "static": [100.0, 100.0, 50.0]})
    assert p["steal"]["static"]["per_round"] == [-1.0, 10.0, 0.0]
    assert p["steal"]["static"]["median"] == 0.0
    assert p["static"]["steal"]["per_round"][1] == pytest.approx(-9.09, abs=0.01)
    with pytest.raises(ValueError, match="rounds"):
        paired_pct({"a": [1.0], "b": [1.0, 2.0]})


def row(span, migrations=0):
    return {"makespan_s": span, "ratio_to_lower_bound": span / 10, "tokens_per_s": 1000 / span, "tail_s": 1.0,
            "utilization": 0.5, "migrations": migrations, "reprefill_pct": 0.0, "decision_ms_mean": 0.1,
            "decision_ms_p99": 0.2}


def run_of(rows_by_policy):
    results, picked, rep = summarize_seed(rows_by_policy)
    return {"engine": "vllm", "replicas": 2, "sequences": 4, "generated_tokens": 100, "lower_bound_s": 10.0,
            "balance_bound_s": 12.0, "results": results, "profile": "p", "bound_note": "n", "repeats": rep}, picked


def test_summarize_seed_and_combine_report_the_worst_seed():
    seed0, picked = run_of({"static": [row(100), row(120), row(110)], "steal": [row(90, 2), row(130), row(95, 1)]})
    assert picked == {"static": 2, "steal": 2}
    assert seed0["results"]["static"]["makespan_s"] == 110
    assert seed0["results"]["steal"]["makespans_s"] == [90, 130, 95]
    assert seed0["results"]["steal"]["migrations_by_round"] == [2, 0, 1]
    assert seed0["results"]["steal"]["migrations"] == 1  # the median run's
    assert seed0["results"]["steal"]["makespan_spread_pct"] == pytest.approx(100 * 40 / 95, abs=0.01)
    seed1, _ = run_of({"static": [row(50), row(50), row(50)], "steal": [row(52), row(51), row(60)]})
    out = combine([seed0, seed1], [0, 1])
    worst = out["repeats"]["worst_seed_median_pct"]
    assert worst["steal"]["static"] == 4.0  # seed 1: rounds +4, +2, +20 -> median +4; seed 0's median is -10
    assert worst["static"]["steal"] == 11.11  # seed 0: rounds +11.11, -7.69, +15.79; seed 1's median is -3.85
    assert out["results"]["steal"]["makespan_s"] == pytest.approx((95 + 52) / 2)
    text = markdown(out)
    assert "steal vs static +4.00 %" in text
    assert "steal 90.00, 130.00, 95.00" in text
    assert "migrations by round: steal 2, 0, 1" in text


def test_across_seeds_keeps_the_largest_median():
    reps = [{"rounds": 2, "paired_pct": paired_pct({"a": [1.0, 1.0], "b": [1.0, 1.0]})},
            {"rounds": 2, "paired_pct": paired_pct({"a": [1.1, 1.3], "b": [1.0, 1.0]})}]
    assert across_seeds(reps)["worst_seed_median_pct"]["a"]["b"] == 20.0


def test_repeats_refused_on_the_simulator(tmp_path, capsys):
    from rollout_cluster.cli import main

    assert main(["bench", "--engine", "sim", "--repeats", "3", "--out", str(tmp_path)]) == 2
    assert "rollout-cluster bench: error: --repeats=3" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:  # argparse's refusal (cli_types.at_least)
        main(["bench", "--engine", "vllm", "--repeats", "0", "--out", str(tmp_path)])
    assert refused.value.code == 2
    assert "argument --repeats: must be an integer >= 1, not '0'" in capsys.readouterr().err


def test_a_cluster_of_simulated_replicas_says_so_in_the_report():
    from rollout_cluster.bench.report import run_summary
    from rollout_cluster.bench.run import combine

    run = {"engine": "vllm", "replica_engine": "sim", "replicas": 32, "sequences": 8, "generated_tokens": 9,
           "lower_bound_s": 1.0, "balance_bound_s": 2.0, "results": {}, "profile": "h200-1.5b", "bound_note": "",
           "workload": {}}
    assert "replicas host simulated engines" in run_summary(run)
    assert "simulated" not in run_summary({**run, "replica_engine": "vllm"})
    assert combine([run, dict(run)], [0, 1])["replica_engine"] == "sim"
