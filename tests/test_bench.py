"""Benchmark tooling: workloads, trace files, bench.json/md/png, the simulate CLI, the calibration
fit. No Ray, no vLLM."""
import json
import math
import statistics

import pytest

from rollout_cluster.bench.calibrate import fit, parse_ints, step_curve
from rollout_cluster.bench.report import trace_by_replica
from rollout_cluster.bench.run import METRICS, PREFILLED, percentile, tail_s
from rollout_cluster.bench.vllm_run import utilization
from rollout_cluster.bench.workloads import LongtailSpec, load_trace, parse_trace, rl_longtail, write_trace
from rollout_cluster.cli import main

TINY = ["--replicas", "3", "--prompts", "6", "--samples", "4", "--median", "200", "--max-tokens", "1024"]


# ---- workloads ------------------------------------------------------------------------------
def test_rl_longtail_shape_and_determinism():
    spec = LongtailSpec(prompts=40, samples=8, median=300, max_tokens=2048, seed=3, prompt_min=100, prompt_max=200)
    reqs = rl_longtail(spec)
    assert len(reqs) == 320
    assert [(r.prompt_index, r.sample_index) for r in reqs[:9]] == [(0, j) for j in range(8)] + [(1, 0)]
    lengths = [r.hidden_length for r in reqs]
    assert min(lengths) >= 16 and max(lengths) <= 2048
    assert all(100 <= r.prompt_len <= 200 and r.prompt_token_ids is None for r in reqs)
    assert all(r.sampling.max_tokens == 2048 and r.sampling.ignore_eos for r in reqs)
    assert lengths == [r.hidden_length for r in rl_longtail(spec)]  # seeded
    assert lengths != [r.hidden_length for r in rl_longtail(LongtailSpec(**{**spec.__dict__, "seed": 4}))]
    # the median of the lengths sits near M (lognormal around the difficulty, itself around M)
    assert 150 < statistics.median(lengths) < 600


def test_rl_longtail_ids_do_not_change_lengths():
    spec = LongtailSpec(prompts=10, samples=3, median=100, max_tokens=512)
    sim = rl_longtail(spec)
    real = rl_longtail(spec, vocab_size=500)
    other = rl_longtail(spec, vocab_size=500, ids_salt="-steal")
    assert [r.hidden_length for r in sim] == [r.hidden_length for r in real] == [r.hidden_length for r in other]
    for r in real:
        assert len(r.prompt_token_ids) == r.prompt_len and all(3 <= t < 500 for t in r.prompt_token_ids)
    assert real[0].prompt_token_ids is real[1].prompt_token_ids  # siblings share the prompt
    assert real[0].prompt_token_ids != other[0].prompt_token_ids


def test_rl_longtail_clips_to_the_cap():
    reqs = rl_longtail(LongtailSpec(prompts=20, samples=4, median=5000, sigma_prompt=0.1, max_tokens=1000))
    assert {r.hidden_length for r in reqs} == {1000}


def test_trace_round_trip(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("group,prompt_tokens,response_tokens\nqA,10,5\nqA,10,7\n\nqB,20,30\n")
    reqs = load_trace(path)
    assert [(r.prompt_index, r.sample_index, r.prompt_len, r.hidden_length) for r in reqs] == \
        [(0, 0, 10, 5), (0, 1, 10, 7), (1, 0, 20, 30)]
    assert reqs[0].sampling.max_tokens == 30  # the longest response
    assert load_trace(path, max_tokens=64)[0].sampling.max_tokens == 64
    ids = load_trace(path, vocab_size=100)
    assert ids[0].prompt_token_ids is ids[1].prompt_token_ids and len(ids[2].prompt_token_ids) == 20
    write_trace(reqs, tmp_path / "u.csv")
    assert [r.hidden_length for r in load_trace(tmp_path / "u.csv")] == [5, 7, 30]


@pytest.mark.parametrize("body, line, words", [
    ("group,prompt,response\n1,2,3\n", 1, "header"),
    ("", 1, "empty"),
    ("group,prompt_tokens,response_tokens\na,1,2\nb,3\n", 3, "expected 3 fields"),
    ("group,prompt_tokens,response_tokens\na,1,2\n\nb,x,2\n", 4, "prompt_tokens='x' is not an integer"),
    ("group,prompt_tokens,response_tokens\na,1,0\n", 2, "response_tokens=0 must be >= 1"),
    ("group,prompt_tokens,response_tokens\na,5,2\na,6,2\n", 3, "earlier row"),
    ("group,prompt_tokens,response_tokens\n,5,2\n", 2, "group is empty"),
    ("group,prompt_tokens,response_tokens\na,5,2,9\n", 2, "got 4"),
])
def test_trace_refuses_malformed_lines(tmp_path, body, line, words):
    path = tmp_path / "bad.csv"
    path.write_text(body)
    with pytest.raises(ValueError) as err:
        load_trace(path)
    assert f"line {line}:" in str(err.value) and words in str(err.value)


def test_trace_refuses_responses_over_max_tokens():
    with pytest.raises(ValueError, match=r"line 3: response_tokens=90 exceeds max_tokens=64"):
        parse_trace(["group,prompt_tokens,response_tokens", "a,5,2", "a,5,90"], "t", max_tokens=64)


# ---- metrics --------------------------------------------------------------------------------
def test_tail_and_percentile():
    assert tail_s([float(i) for i in range(1, 11)]) == 1.0  # 9 of 10 done at t=9, all at t=10
    assert tail_s([1.0] * 19 + [50.0]) == 49.0
    assert percentile([5.0, 1.0, 3.0], 0.99) == 5.0 and percentile(list(range(100)), 0.5) == 49


def test_utilization_from_pull_trace():
    tr = trace_by_replica([(0.0, "a", 3), (2.0, "a", 0), (0.0, "b", 1), (3.0, "b", 1), (1.0, "a", 2)])
    assert tr["a"] == [(0.0, 3), (1.0, 2), (2.0, 0)]
    assert utilization(tr, 4.0, 2) == pytest.approx((2.0 + 4.0) / 8.0)


# ---- bench output ---------------------------------------------------------------------------
def test_bench_writes_json_md_png(tmp_path, capsys):
    out = tmp_path / "b"
    assert main(["bench", "--engine", "sim", "--policies", "static,pull,steal", "--out", str(out)] + TINY) == 0
    data = json.loads((out / "bench.json").read_text())
    for key in ("engine", "replicas", "sequences", "generated_tokens", "lower_bound_s", "balance_bound_s", "results"):
        assert key in data
    assert (data["engine"], data["replicas"], data["sequences"]) == ("sim", 3, 24)
    reqs = rl_longtail(LongtailSpec(prompts=6, samples=4, median=200, max_tokens=1024))
    assert data["generated_tokens"] == sum(r.hidden_length for r in reqs)
    assert list(data["results"]) == ["static", "pull", "steal"]
    lb = data["lower_bound_s"]
    assert 0 < lb <= data["balance_bound_s"]
    for name, row in data["results"].items():
        assert list(row) == list(METRICS) + [PREFILLED]  # the simulator also reports what it prefilled
        assert 0 <= row[PREFILLED] <= row["reprefill_pct"]
        assert row["makespan_s"] >= lb
        assert row["ratio_to_lower_bound"] == pytest.approx(row["makespan_s"] / lb, rel=1e-3)
        assert row["tokens_per_s"] == pytest.approx(data["generated_tokens"] / row["makespan_s"], rel=1e-3)
        assert 0 < row["utilization"] <= 1 and 0 <= row["tail_s"] < row["makespan_s"]
    assert data["results"]["static"]["migrations"] == 0 and data["results"]["static"]["reprefill_pct"] == 0
    md = (out / "bench.md").read_text()
    assert "| static |" in md and "| steal |" in md and f"{lb:.2f}" in md
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert "| pull |" in capsys.readouterr().out


def test_bench_with_several_seeds_reports_each_and_the_mean(tmp_path):
    out = tmp_path / "s"
    main(["bench", "--policies", "pull", "--seeds", "0,1", "--out", str(out)] + TINY)
    data = json.loads((out / "bench.json").read_text())
    assert data["seeds"] == [0, 1] and [r["seed"] for r in data["per_seed"]] == [0, 1]
    spans = [r["results"]["pull"]["makespan_s"] for r in data["per_seed"]]
    assert spans[0] != spans[1]
    assert data["results"]["pull"]["makespan_s"] == pytest.approx(sum(spans) / 2, abs=1e-3)
    assert data["lower_bound_s"] == pytest.approx(sum(r["lower_bound_s"] for r in data["per_seed"]) / 2, abs=1e-3)


def test_simulate_prints_bench_json(capsys):
    assert main(["simulate", "--policy", "pull"] + TINY) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["engine"], data["sequences"], list(data["results"])) == ("sim", 24, ["pull"])
    row = data["results"]["pull"]
    assert row["makespan_s"] >= data["lower_bound_s"] > 0 and row["migrations"] == 0


def test_simulate_on_a_trace(tmp_path, capsys):
    path = tmp_path / "t.csv"
    path.write_text("group,prompt_tokens,response_tokens\n" + "".join(f"g{i // 2},100,{50 + 10 * i}\n" for i in range(8)))
    main(["simulate", "--policy", "static", "--trace", str(path), "--replicas", "2"])
    data = json.loads(capsys.readouterr().out)
    assert data["sequences"] == 8 and data["generated_tokens"] == sum(50 + 10 * i for i in range(8))
    assert data["workload"]["workload"] == "trace"


def test_unknown_policy_is_refused(capsys):
    assert main(["bench", "--policies", "pull,fastest", "--out", "/tmp/never"] + TINY) == 2
    assert "--policies='pull,fastest': unknown fastest; choose from" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--prompts", "0"], "argument --prompts: must be an integer >= 1, not '0'"),  # (argparse's: cli_types)
    (["--sigma-sample", "-0.5"], "--sigma-sample=-0.5: must be >= 0"),
    (["--prompt-min", "900", "--prompt-max", "800"], "--prompt-min=900: must be >= 1 and <= --prompt-max (800)"),
])
def test_workload_flags_out_of_range_are_refused_naming_the_flag(capsys, flags, message):
    try:
        rc = main(["simulate", "--policy", "static", "--replicas", "2"] + flags)
    except SystemExit as e:  # argparse's own refusal
        rc = e.code
    assert rc == 2
    assert message in capsys.readouterr().err


# ---- calibration fit ------------------------------------------------------------------------
def test_calibration_fit_recovers_a_known_model():
    a, c, e, rate = 4e-3, 1.5e-8, 2e-5, 40000.0
    points = []
    for b in (1, 4, 16, 32):
        for ctx in (64, 512, 1024):
            context = b * (ctx + 16.5)
            step = a + c * context + e * b
            points.append({"batch": b, "context": ctx, "batch_context_tokens": context, "step_s": step,
                           "prefill_s": b * ctx / rate + a + c * b * ctx + e * b})
    got = fit(points)
    assert got["a"] == pytest.approx(a, rel=1e-6) and got["c"] == pytest.approx(c, rel=1e-6)
    assert got["e"] == pytest.approx(e, rel=1e-6) and got["prefill_tokens_per_s"] == pytest.approx(rate, rel=1e-6)
    assert got["max_rel_error"] < 1e-9
    curve = step_curve(points)
    assert "step(B=32) / step(B=1) = " in curve
    ratio = float(curve.rsplit("= ", 1)[1])
    assert math.isclose(ratio, (a + c * 32 * 80.5 + e * 32) / (a + c * 80.5 + e), rel_tol=0.01)


def test_calibration_fit_never_returns_a_negative_cost():
    points = [{"batch": b, "context": 64, "batch_context_tokens": b * 80, "step_s": 0.01 - 1e-5 * b,
               "prefill_s": 0.02} for b in (1, 2, 4, 8)]
    got = fit(points)
    assert got["c"] >= 0 and got["e"] >= 0


def test_parse_ints():
    assert parse_ints("1,2, 8", "--batches") == [1, 2, 8]
    with pytest.raises(ValueError, match="--batches"):
        parse_ints("1,x", "--batches")


def test_calibrate_loads_a_config_whose_profile_it_is_about_to_write(tmp_path):
    from rollout_cluster.bench.calibrate import engine_config

    (tmp_path / "configs").mkdir()
    path = tmp_path / "configs" / "c.yaml"
    path.write_text("replicas: 1\nengine:\n  model: models/m\n  max_num_seqs: 8\n  sim_profile: configs/profiles/new.yaml\n")
    cfg = engine_config(str(path))
    assert cfg.engine.max_num_seqs == 8 and cfg.base_dir == str(tmp_path.resolve())


def test_chunk_reprefill_matches_the_simulated_rounds():
    from rollout_cluster.bench.vllm_run import chunk_reprefill
    from rollout_cluster.config import PolicyConfig
    from rollout_cluster.engines.cost_model import load_profile
    from rollout_cluster.policy import make_policy
    from rollout_cluster.sim.simulator import Simulation

    reqs = rl_longtail(LongtailSpec(prompts=8, samples=4, median=300, max_tokens=2048))
    cost = load_profile("a100-80g-7b")
    res = Simulation(make_policy(PolicyConfig(name="chunked", chunk_tokens=128), cost), cost, 3).run(reqs)
    lengths = [r.hidden_length for r in reqs]
    assert chunk_reprefill(reqs, lengths, 128) == res.reprefill_tokens > 0
    assert chunk_reprefill(reqs[:1], [256], 128) == reqs[0].prompt_len + 128  # one restart, not two


def test_sim_engine_never_imports_ray_or_vllm(tmp_path):
    import subprocess
    import sys

    code = ("import sys; from rollout_cluster.cli import main; "
            f"main(['bench', '--policies', 'pull,steal', '--out', {str(tmp_path)!r}] + {TINY!r}); "
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'vllm', 'torch')); "
            "assert not heavy, heavy")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]


def test_calibration_fit_drops_points_spoiled_by_interference():
    a, c, e = 1e-2, 4e-7, 5e-4
    points = [{"batch": b, "context": ctx, "batch_context_tokens": b * ctx, "step_s": a + c * b * ctx + e * b,
               "prefill_s": 0.1 * b} for b in (1, 4, 16) for ctx in (64, 512)]
    points.append({"batch": 32, "context": 1024, "batch_context_tokens": 32 * 1024, "step_s": 1e-9, "prefill_s": 50.0})
    got = fit(points)
    assert got["dropped_points"] == [(32, 1024)]
    assert got["a"] == pytest.approx(a, rel=1e-6) and got["max_rel_error"] < 1e-9


def test_simulate_takes_replicas_and_policy_tunables_from_a_config(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("replicas: 5\nengine:\n  kind: sim\n  max_num_seqs: 4\npolicy:\n  name: chunked\n  chunk_tokens: 64\n")
    main(["simulate", "--policy", "chunked", "--config", str(cfg), "--prompts", "5", "--samples", "4",
          "--median", "200", "--max-tokens", "512"])
    data = json.loads(capsys.readouterr().out)
    assert data["replicas"] == 5
    reqs = rl_longtail(LongtailSpec(prompts=5, samples=4, median=200, max_tokens=512))
    from rollout_cluster.bench.vllm_run import chunk_reprefill

    expected = chunk_reprefill(reqs, [r.hidden_length for r in reqs], 64)  # the config's chunk, not 1024
    assert data["results"]["chunked"]["reprefill_pct"] == pytest.approx(100 * expected / data["generated_tokens"], abs=1e-3)


class _TimedFakeEngine:
    """Just enough of VllmEngine for calibrate.measure: a request takes prefill + tokens x step,
    and a step costs more the more engines are decoding at once (shared cores)."""

    busy = 0

    def __init__(self, step_s: float):
        self.step_s = step_s
        self.tasks = {}

    def submit(self, work):
        import asyncio

        async def run():
            _TimedFakeEngine.busy += 1
            try:
                await asyncio.sleep(work.sampling.max_tokens * self.step_s * _TimedFakeEngine.busy)
            finally:
                _TimedFakeEngine.busy -= 1
        self.tasks[(work.seq_id, work.attempt)] = asyncio.get_running_loop().create_task(run())

    def drain(self):
        return []


def test_calibrate_measures_engines_together_and_sees_their_contention():
    import asyncio

    from rollout_cluster.bench.calibrate import measure

    # Timers on a loaded machine only add time; 10 ms steps keep that noise small against the 1.5x.
    alone = asyncio.run(measure(_TimedFakeEngine(0.01), [1], [8], 10, 100, repeats=2))
    together = asyncio.run(measure([_TimedFakeEngine(0.01), _TimedFakeEngine(0.01)], [1], [8], 10, 100, repeats=2))
    assert alone[0]["step_s"] == pytest.approx(0.01, rel=0.4)
    assert together[0]["step_s"] > 1.25 * alone[0]["step_s"]


def test_profile_fitted_from_replica_step_reports_recovers_the_curve(tmp_path):
    """`calibrate --from-samples`: a, c, e from (running, context, step) reports of a cluster run."""
    import json
    import random
    from types import SimpleNamespace

    from rollout_cluster.bench.calibrate import calibrate
    from rollout_cluster.engines.cost_model import load_profile

    rng = random.Random(0)
    truth = dict(a=0.02, c=3e-6, e=1.5e-3)
    samples = []
    for _ in range(400):
        b, ctx = rng.randint(1, 32), rng.randint(10, 40_000)
        samples.append([b, ctx, (truth["a"] + truth["c"] * ctx + truth["e"] * b) * rng.uniform(0.95, 1.05)])
    path = tmp_path / "step_samples.json"
    path.write_text(json.dumps({"seed 3 static": samples, "seed 3 steal": [[0, 0, 0.1]]}))
    out = tmp_path / "fitted.yaml"
    args = SimpleNamespace(from_samples=str(path), base_profile="a100-80g-7b", samples_of="static", name=None,
                           out=str(out), config=None)
    model = calibrate(args)
    assert model.a == pytest.approx(truth["a"], rel=0.1)
    assert model.c == pytest.approx(truth["c"], rel=0.1)
    assert model.e == pytest.approx(truth["e"], rel=0.2)
    again = load_profile(str(out))
    assert again.a == pytest.approx(model.a) and again.prefill_tokens_per_s == load_profile("a100-80g-7b").prefill_tokens_per_s
    with pytest.raises(ValueError, match="samples-of"):
        calibrate(SimpleNamespace(**{**vars(args), "samples_of": "seed 9"}))
    with pytest.raises(ValueError, match=r"from-samples=.*seed 3 steal.*only 0 usable"):
        calibrate(SimpleNamespace(**{**vars(args), "samples_of": "steal"}))


def test_prefilled_reprefill_counts_cache_hits_out(tmp_path):
    """chunked re-sends every continuation's context; continuing on the replica it last ran on, most
    of it is cached, so what is prefilled is a small part of what is sent. Migrations (steal)
    land on another replica: there little is cached beyond the group's prompt."""
    out = tmp_path / "p"
    longer = ["--replicas", "3", "--prompts", "6", "--samples", "4", "--median", "1500", "--max-tokens", "4096"]
    assert main(["bench", "--engine", "sim", "--policies", "chunked,steal", "--out", str(out)] + longer) == 0
    rows = json.loads((out / "bench.json").read_text())["results"]
    chunked = rows["chunked"]
    assert chunked["reprefill_pct"] > 50 and chunked[PREFILLED] < 0.5 * chunked["reprefill_pct"]
    assert "of it prefilled" in (out / "bench.md").read_text()
