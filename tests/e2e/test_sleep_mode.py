"""vLLM sleep mode on the real cluster (RolloutClient.sleep / wake): both vLLM-CPU engines say
they sleep (AsyncLLM.is_sleeping), a batch is refused until wake, a light sleep keeps the weights,
and a deep one reloads at wake the weights an update made while asleep names. The CPU build frees
no memory (it has no CuMem allocator); what that saves on a GPU is not measured here."""
import json
import subprocess

import pytest

from rollout_cluster.model_maker import make_model

from e2e_support import ROOT, VENV_BIN, ray_env
from test_weights_update import GREEDY, PROMPTS, by_prompt, tokens

pytestmark = pytest.mark.e2e


def test_sleep_refuses_batches_until_wake_and_a_deep_wake_loads_the_latest_weights(client, tmp_path):
    original = str(ROOT / "models" / "tiny-llama")
    before = by_prompt(tokens(client))

    st = client.sleep(1)
    assert st["sleep"]["level"] == 1 and set(st["sleep"]["replicas"].values()) == {1}
    assert len(st["sleep"]["replicas"]) == 2  # both engines said so themselves
    with pytest.raises(Exception, match=r"asleep \(level 1, RolloutClient.sleep\): call wake\(\)"):
        client.generate(PROMPTS, GREEDY)
    with pytest.raises(Exception, match="asleep at level 1 already"):
        client.sleep(2)
    # a replica started now would allocate its engine's memory before it learns the fleet sleeps
    with pytest.raises(RuntimeError, match=r"scale: the fleet sleeps \(level 1\); wake\(\) first"):
        client.scale(3)
    # the command line, attached to the running app (as a trainer's launcher would)
    run = subprocess.run([str(VENV_BIN / "rollout-cluster"), "wake", "--app-name", client.app_name],
                         env=ray_env(), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(next(line for line in reversed(run.stdout.splitlines()) if line.startswith("{")))
    assert out["level"] == 0 and set(out["replicas"].values()) == {0}
    assert by_prompt(tokens(client)) == before  # level 1 kept the weights

    # Level 2: the weights are dropped; an update made while asleep returns at once and is what
    # wake() reloads (one load, not the old weights and then the new).
    other = make_model(str(tmp_path / "step"), seed=1)
    client.sleep(2)
    v = client.update_weights(str(other))
    assert set(client.status()["weights"]["replicas"].values()) == {v - 1}  # nothing loaded yet
    wake_on_the_update_then_restore(client, v, before, original)


def wake_on_the_update_then_restore(client, v: int, before: list, original: str) -> None:
    """wake() loads version v, the update made while asleep; then the original weights are back."""
    st = client.wake()
    assert set(st["weights"]["replicas"].values()) == {v} and set(st["sleep"]["replicas"].values()) == {0}
    after = tokens(client)
    assert {c.weights_version for c in after} == {v} and by_prompt(after) != before

    client.update_weights(original)  # the next tests' weights
    assert by_prompt(tokens(client)) == before
