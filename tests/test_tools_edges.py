"""The tools beside the package (scripts/, experiments/*/) with partial or odd input: timelines
of a run cut short, a missing profile, a process gone while sampled, too few rounds. No Ray, no
vLLM: each tool's functions are loaded by path."""
import importlib.util
import json
import runpy
import sys
import time
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMELINE_SUMMARY = ROOT / "experiments" / "router-overhead" / "timeline_summary.py"


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def run_script(path: Path, argv: list, monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(path)] + [str(a) for a in argv])
    return runpy.run_path(str(path), run_name="__main__")


def pull_line(t, held, start=0, tokens=8):
    return {"kind": "pull", "t": t, "held": held, "progress": 4, "tokens": tokens, "start": start,
            "report_ms": 0.3, "pull_ms": 1.0, "apply_ms": 0.1, "pace_ms": 50.0}


# --- experiments/router-overhead/timeline_summary.py -------------------------------------------

def test_timeline_summary_percentile_is_nearest_rank_like_the_bench_percentile():
    # int(q * n) is one rank too high whenever q * n is whole: p99 of 100 samples is the max,
    # the "median" of an even count is its upper middle.
    from rollout_cluster.bench.run import percentile

    ts = load(TIMELINE_SUMMARY, "timeline_summary_review")
    hundred = list(range(1, 101))
    assert ts.pct(hundred, 0.99) == percentile(hundred, 0.99) == 99
    assert ts.pct(list(range(1, 11)), 0.9) == percentile(list(range(1, 11)), 0.9) == 9
    assert ts.pct([1, 2, 3, 4], 0.5) == percentile([1, 2, 3, 4], 0.5) == 2


def test_timeline_summary_lag_of_a_timeline_without_lag_samples_prints_instead_of_crashing(capsys):
    ts = load(TIMELINE_SUMMARY, "timeline_summary_review")
    ts.lag([pull_line(0.1, 4)], "replica-0")  # max() of no lags: ValueError
    assert "0 samples" in capsys.readouterr().out


def test_timeline_summary_of_an_empty_timeline_file_summarises_the_others(tmp_path, monkeypatch, capsys):
    # a replica killed before its 64 KiB buffer was flushed leaves an empty file
    (tmp_path / "bare.jsonl").write_text("")
    (tmp_path / "replica-0.jsonl").write_text(
        "".join(json.dumps(x) + "\n" for x in [{"kind": "lag", "t": 0.05, "worst_ms": 0.4}, pull_line(0.1, 4, 4)]))
    run_script(TIMELINE_SUMMARY, [tmp_path], monkeypatch)
    out = capsys.readouterr().out
    assert "bare: event-loop lag over 0 samples" in out and "replica: 1 pulls" in out


def test_timeline_summary_of_a_run_cut_short_ignores_the_torn_last_line(tmp_path, monkeypatch, capsys):
    # the timeline is block-buffered: a run killed by `timeout` leaves half a line at the end
    lines = [{"kind": "lag", "t": 0.05 * i, "worst_ms": 0.4} for i in range(1, 5)] + [pull_line(0.3, 8, 8)]
    text = "".join(json.dumps(x) + "\n" for x in lines) + '{"kind": "lag", "t": 0.3, "wor'
    (tmp_path / "replica-0.jsonl").write_text(text)
    run_script(TIMELINE_SUMMARY, [tmp_path], monkeypatch)
    out = capsys.readouterr().out
    assert "replica-0: event-loop lag over 4 samples" in out


def test_timeline_summary_reports_a_missing_pyspy_file_and_goes_on_to_the_next(tmp_path, monkeypatch, capsys):
    # gpu.sh's profile() writes no file when it found no process to sample
    (tmp_path / "timeline").mkdir()
    present = tmp_path / "pyspy-bare.txt"
    present.write_text("main;run;step 7\nmain;run;wait 3\n")
    run_script(TIMELINE_SUMMARY, [tmp_path / "timeline", tmp_path / "pyspy-replica.txt", present], monkeypatch)
    assert f"{present}: 10 active samples" in capsys.readouterr().out


# --- scripts/router_pull_cost.py ----------------------------------------------------------------

def test_router_pull_cost_parses_its_arguments_with_the_config_default_budget(monkeypatch, capsys):
    # RouterConfig is a pydantic model: RouterConfig.max_pulls_per_s raises AttributeError, so the
    # script dies before argparse (even --help) and never reaches ray.init.
    with pytest.raises(SystemExit) as done:
        run_script(ROOT / "scripts" / "router_pull_cost.py", ["--help"], monkeypatch)
    assert done.value.code == 0
    assert "--max-pulls-per-s" in capsys.readouterr().out


# --- experiments/target-consistency/run.py ------------------------------------------------------

def test_target_consistency_table_of_a_bench_without_the_policy_shows_a_dash(tmp_path, capsys):
    # rows() records None for a policy the bench did not run; markdown() formats None with :.2f
    tc = load(ROOT / "experiments" / "target-consistency" / "run.py", "target_consistency_review")
    bench = {"seed": 0, "balance_bound_s": 250.0, "results": {"static": {"makespan_s": 300.0}}}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    tc.main([str(path), "--policy", "pull"])
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 3 and out[2].startswith("| 0 | 300.00 | 250.00 |")


# --- scripts/soak.py ----------------------------------------------------------------------------

def test_soak_memory_of_a_process_that_exits_while_sampled_is_skipped(monkeypatch):
    # memory() catches NoSuchProcess for every process it reads, then indexes out[""] (the
    # process itself) unconditionally: a replica that exits between list_actors and the sample
    # turns into KeyError('') and ends the whole soak.
    import psutil

    soak = load(ROOT / "scripts" / "soak.py", "soak_review")

    class Gone:
        def __init__(self, pid):
            self.pid = pid

        def children(self, recursive=False):
            return []

        def memory_full_info(self):
            raise psutil.NoSuchProcess(self.pid)

        def name(self):
            raise psutil.NoSuchProcess(self.pid)

    monkeypatch.setattr(psutil, "Process", Gone)
    assert soak.memory(12345) == {}


# --- experiments/weights-sync/stream_ab.py ------------------------------------------------------

def test_stream_ab_with_two_rounds_still_writes_its_results(tmp_path, monkeypatch):
    # warm = rows[2:] is empty for --rounds 1 or 2: statistics.median raises after every push
    # was made, and stream_ab.json is never written.
    import torch

    import rollout_cluster.client.client as client_mod

    class FakeClient:
        def push_weights(self, named, bucket_bytes=None):
            list(named)
            time.sleep(0.003)  # (a push of 0.000 s would divide by zero in the ratio)
            return 1

        def shutdown(self):
            pass

    fake_tf = types.ModuleType("transformers")
    fake_tf.AutoModelForCausalLM = types.SimpleNamespace(from_pretrained=lambda *a, **k: torch.nn.Linear(2, 2))
    monkeypatch.setitem(sys.modules, "transformers", fake_tf)
    monkeypatch.setattr(client_mod.RolloutClient, "start", classmethod(lambda cls, cfg, **k: FakeClient()))
    monkeypatch.chdir(ROOT)
    model = tmp_path / "model"
    model.mkdir()
    out = tmp_path / "out"
    try:
        run_script(ROOT / "experiments" / "weights-sync" / "stream_ab.py",
                   ["--model-dir", model, "--rounds", "2", "--out", out], monkeypatch)
    finally:
        from rollout_cluster.transfer.push import STREAM_ENV
        monkeypatch.delenv(STREAM_ENV, raising=False)
    saved = json.loads((out / "stream_ab.json").read_text())
    assert len(saved["rounds"]) == 2
