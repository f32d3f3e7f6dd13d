"""examples/grpo/train.py, three steps against the shared cluster: the mechanics of an RL loop.

The example attaches to the running app (--app-name), trains a policy of the served model's
architecture, and pushes it every step (push_weights; at the end once more, and once by checkpoint
+ update_weights). Checked: the weights version advances by one a sync and every step's rollouts
ran on the version of the sync before; the engines then generate other tokens, and their logprobs
are the trainer's on the same weights; every sample comes back once (in its step, or cut and
finished in the next one). The shared cluster gets its original weights back at the end.
"""
import json
import subprocess
import sys

import pytest

from rollout_cluster.protocol import SamplingSpec

from e2e_support import ROOT, ray_env

pytestmark = pytest.mark.e2e

STEPS, PROMPTS, N = 3, 12, 4
SEP, BOS, DIGIT0 = 20, 1, 10  # examples/grpo/task.py's token ids
PROBES = [[BOS] + [DIGIT0 + d for d in digits] + [SEP] for digits in ([1, 2, 3], [9, 8, 7, 6, 5], [4, 0, 4, 0])]
GREEDY = SamplingSpec(n=1, max_tokens=12, temperature=0.0, logprobs=0)


def greedy(client):
    return [tuple(c.token_ids) for c in client.generate(PROBES, GREEDY)]


def test_grpo_example_three_steps(client, cluster_config, tmp_path):
    v0 = client.status()["weights"]["version"]
    before = greedy(client)
    out = tmp_path / "out"
    cmd = [sys.executable, str(ROOT / "examples" / "grpo" / "train.py"), "--config", str(ROOT / "configs" / "local-cpu.yaml"),
           "--app-name", cluster_config.app_name, "--address", "auto", "--steps", str(STEPS), "--out", str(out),
           "--checkpoint-dir", str(tmp_path / "ckpt"), "--warm-steps", "30", "--prompts", str(PROMPTS), "--n", str(N),
           "--finish-fraction", "0.5", "--finish-by", "sample", "--min-digits", "1", "--max-digits", "16", "--sync", "push", "--compare-sync", "1"]
    run = subprocess.run(cmd, env=ray_env(), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    assert (out / "grpo.png").stat().st_size > 0

    # the weights version advances: the warm start's sync, then one a step; each step's rollouts
    # all ran on the weights of the sync before it (the batch is pinned to that version)
    assert summary["first_sync"]["version"] == v0 + 1
    assert [r["weights_version"] for r in rows] == [v0 + 1 + k for k in range(STEPS)]
    assert [r["next_version"] for r in rows] == [v0 + 2 + k for k in range(STEPS)]
    assert all(r["rollout_versions"] == [r["weights_version"]] for r in rows)
    # --compare-sync 1: the last weights once more by push, then by checkpoint + update_weights
    assert [t["repeats"] for t in summary["sync_compare"].values()] == [1, 1]
    assert client.status()["weights"]["version"] == v0 + 1 + STEPS + 2
    # the engines hold the trainer's weights: their sampling logprobs are the trainer's, every step
    assert all(r["samples"] > 0 and r["logprob_mismatch"] < 1e-3 for r in rows), [r["logprob_mismatch"] for r in rows]
    # generated tokens changed with the first push, and the cluster runs on the example's last weights
    after = greedy(client)
    assert after != before

    # every sample back once: each batch returned one completion per sequence it was given (the
    # example raises on a duplicate or a missing one); a sample cut in step k resumed in step k+1;
    # finished samples plus those still carried make every prompt's n samples
    assert all(r["batch"]["returned"] == r["batch"]["sequences"] for r in rows)
    assert [r["batch"]["resumed"] for r in rows[1:]] == [r["batch"]["cut"] for r in rows[:-1]]
    assert sum(r["batch"]["cut"] for r in rows) > 0  # cut at half the batch: partial rollouts ran
    assert rows[0]["batch"]["resumed"] == 0
    assert sum(r["batch"]["finished"] for r in rows) + summary["partials"]["carried_at_end"] == STEPS * PROMPTS * N
    assert sum(r["samples"] for r in rows) == N * sum(r["groups"] for r in rows)

    # leave the shared cluster as it was
    client.update_weights(str(ROOT / "models" / "tiny-llama"))
    assert greedy(client) == before
