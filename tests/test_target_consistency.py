"""experiments/target-consistency/run.py: what issue 4's 1.45x-over-static target asks against the balance bound."""
import json

import pytest

from tests.conftest import load_experiment

tc = load_experiment("target-consistency", "target_consistency")


def _run(seed, static, balance, steal):
    return {"seed": seed, "balance_bound_s": balance,
            "results": {"static": {"makespan_s": static}, "steal": {"makespan_s": steal}}}


def test_a_static_split_close_to_the_balance_bound_asks_for_a_makespan_under_it():
    (row,) = tc.rows({"per_seed": [_run(0, 300.0, 250.0, 265.0)]})
    assert row["needed_s"] == pytest.approx(300.0 / 1.45)
    assert row["needed_vs_balance_pct"] == pytest.approx(100 * (300.0 / 1.45 / 250.0 - 1))
    assert row["needed_vs_balance_pct"] < 0
    assert row["both_possible_for_balancing"] is False
    assert row["steal_vs_balance_pct"] == pytest.approx(6.0)
    assert row["static_over_steal"] == pytest.approx(300.0 / 265.0)


def test_a_badly_stacked_static_split_leaves_room_for_both_targets():
    (row,) = tc.rows({"per_seed": [_run(5, 425.0, 259.0, 275.0)]})
    assert row["best_speedup_few_pct_over"] == pytest.approx(425.0 / (259.0 * 1.03))
    assert row["both_possible_for_balancing"] is True


def test_a_single_seed_bench_json_is_one_row_and_the_table_has_it(tmp_path, capsys):
    bench = dict(_run(0, 324.97, 248.80, 266.20), seed=0)
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    tc.main([str(path)])
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and out[2].startswith("| 0 | 324.97 | 248.80 | 1.306 | 224.1 | -9.9 % | 266.20 | +7.0 % | 1.221 |")
