"""`rollout-cluster bench --engine vllm` on the shared cluster: every policy runs the same batch,
repeated in rotated rounds; rows are the median run, and paired differences match the runs."""
import argparse
import json

import pytest

from rollout_cluster.bench.report import write_reports
from rollout_cluster.bench.run import combine, cost_model
from rollout_cluster.bench.vllm_run import bench_on_cluster

pytestmark = pytest.mark.e2e


def tiny_args(out) -> argparse.Namespace:
    return argparse.Namespace(
        engine="vllm", trace=None, prompts=3, samples=2, median=24.0, sigma_prompt=1.0, sigma_sample=0.4,
        max_tokens=96, prompt_min=8, prompt_max=16, seed=0, profile=None, config=None, replicas=None,
        timeout_s=300.0, repeats=2, out=str(out))


def test_bench_repeats_on_real_replicas(client, cluster_config, fresh_policy, tmp_path):
    args = tiny_args(tmp_path)
    cost = cost_model(args, cluster_config)
    runs, traces, batches, vocab = bench_on_cluster(client, cluster_config, args, ["static", "steal"], [0],
                                                    cost, "test bounds")
    assert vocab == int(client.status()["model"]["vocab_size"])
    (run,) = runs
    generated = run["generated_tokens"]
    assert generated == sum(r.hidden_length for r in batches[0])
    for name in ("static", "steal"):
        row = run["results"][name]
        spans = row["makespans_s"]
        assert len(spans) == 2 and all(s > 0 for s in spans)
        assert row["makespan_s"] == min(spans)  # lower median of two rounds
        # every token of the batch was generated in the reported run
        assert row["tokens_per_s"] * row["makespan_s"] == pytest.approx(generated, rel=1e-3)
        assert set(traces[name])  # the median run's per-replica trace
    paired = run["repeats"]["paired_pct"]["steal"]["static"]["per_round"]
    st, sc = run["results"]["steal"]["makespans_s"], run["results"]["static"]["makespans_s"]
    assert paired == [pytest.approx(100 * (a / b - 1), abs=0.01) for a, b in zip(st, sc)]
    samples = json.loads((tmp_path / "step_samples.json").read_text())
    assert {"seed 0 static r0", "seed 0 static r1", "seed 0 steal r0", "seed 0 steal r1"} <= set(samples)
    result = combine(runs, [0])
    write_reports(result, traces, tmp_path)
    text = (tmp_path / "bench.md").read_text()
    assert "2 rounds per policy" in text and "steal vs static: median" in text
    assert (tmp_path / "bench.png").stat().st_size > 1000
