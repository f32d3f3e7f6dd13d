"""experiments/fleet-scale/run.py: one point per policy and seed, makespan over the balance bound,
from single-seed and multi-seed bench.json files alike."""
import json

import pytest


def bench_json(path, replicas, runs):
    """runs: [(balance bound, {policy: makespan})], one per seed."""
    per_seed = [{"replicas": replicas, "balance_bound_s": bb, "results": {p: {"makespan_s": m} for p, m in res.items()}}
                for bb, res in runs]
    data = dict(per_seed[0], profile="a100-80g-7b")
    if len(per_seed) > 1:
        data["per_seed"] = per_seed
    path.mkdir()
    (path / "bench.json").write_text(json.dumps(data))
    return str(path)


def test_points_are_per_policy_and_seed_and_filtered(tmp_path, fleet_scale_plot):
    one = bench_json(tmp_path / "a", 32, [(200.0, {"static": 300.0, "steal": 220.0, "pull": 300.0})])
    two = bench_json(tmp_path / "b", 256, [(250.0, {"steal": 270.0}), (260.0, {"steal": 286.0})])
    pts = fleet_scale_plot.points([one, two], {"static", "steal"})
    assert set(pts) == {"static", "steal"}
    assert pts["static"] == [(32, pytest.approx(1.5))]
    assert pts["steal"] == [(32, pytest.approx(1.1)), (256, pytest.approx(1.08)), (256, pytest.approx(1.1))]


def test_the_plot_is_written(tmp_path, fleet_scale_plot, monkeypatch):
    d = bench_json(tmp_path / "a", 64, [(250.0, {"steal": 270.0, "static": 330.0})])
    out = tmp_path / "ratio.png"
    monkeypatch.setattr("sys.argv", ["fleet_scale_plot.py", d, "--out", str(out)])
    fleet_scale_plot.main()
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000
