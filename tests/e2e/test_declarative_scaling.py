"""Scaling the engine fleet the way KubeRay does it: a Serve config applied through the dashboard's
REST API (`serve deploy`, which is what a RayService's serveConfigV2 becomes). Changing
`num_replicas` under `deployments:` is an in-place update: the router keeps running, with every
live batch, while replicas join or leave. (Changing the app's `args` would change its code version,
and Serve would restart every deployment: see k8s/README.md.)"""
import json
import subprocess
import time

import pytest
import yaml

from e2e_support import DEFAULT_MAX_TOKENS, ROOT, VENV_BIN, collect, ray_env
from rollout_cluster.config import to_dict
from rollout_cluster.client.client import RolloutClient
from rollout_cluster.client.expand import expand
from rollout_cluster.protocol import InputError, SamplingSpec

pytestmark = pytest.mark.e2e

APP = "scaling"


def serve_config(cluster_config, engine_replicas: int, external_scaler: bool = True) -> dict:
    cfg = cluster_config.model_copy(update=dict(app_name=APP, replicas=1,
                                                metrics=cluster_config.metrics.model_copy(update={"port": 0})))
    args = to_dict(cfg)
    args["engine"]["model"] = str(ROOT / "models" / "tiny-llama")
    return {"applications": [{
        "name": APP, "route_prefix": f"/{APP}", "import_path": "rollout_cluster.serve.app:build",
        "external_scaler_enabled": external_scaler,  # lets RolloutClient.scale set num_replicas
        "args": args, "deployments": [{"name": "EngineReplica", "num_replicas": engine_replicas}]}]}


def serve_deploy(path, config: dict) -> None:
    path.write_text(yaml.safe_dump(config))
    out = subprocess.run([str(VENV_BIN / "serve"), "deploy", str(path), "--address", "http://127.0.0.1:8265"],
                         env=ray_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def batch(first_token: int, lengths: list) -> list:
    prompts = [[first_token + i % 50, 7, 8] for i in range(len(lengths))]
    return expand(prompts, [SamplingSpec(max_tokens=n, ignore_eos=True) for n in lengths])


def wait_running_on(client, n: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while sum(r["running"] > 0 for r in client.status()["replicas"].values()) < n:
        assert time.monotonic() < deadline, client.status()
        time.sleep(0.2)


def test_engine_fleet_scales_in_place_through_the_serve_config(ray_head, cluster_config, tmp_path):
    from ray import serve

    cfg_file = tmp_path / "serve.yaml"
    serve_deploy(cfg_file, serve_config(cluster_config, 1, external_scaler=False))
    with pytest.raises(KeyError, match="app_name='no-such-app': no such Serve application"):
        RolloutClient.connect("no-such-app", wait_s=1)
    client = RolloutClient.connect(APP, wait_s=120)
    try:
        st = client.wait_ready(1, 600)
        router_id = st["router_id"]
        assert st["expected_replicas"] == 1
        # a connected client has no config: the router tells it the app's sampling defaults
        assert client.default_sampling() == SamplingSpec(max_tokens=DEFAULT_MAX_TOKENS)
        # deployed without the external scaler: the driver is told how to scale instead
        with pytest.raises(RuntimeError, match="without external_scaler_enabled.*num_replicas"):
            client.scale(2, timeout_s=5)

        # Grow 1 -> 2 while a batch runs (more sequences than one replica's 64 slots).
        lengths = [300] * 96
        bid = client.submit(batch(100, lengths))
        serve_deploy(cfg_file, serve_config(cluster_config, 2))
        results = collect(client, bid, len(lengths))
        assert [len(c.token_ids) for c in results] == lengths
        st = client.wait_ready(2, 600)
        assert st["router_id"] == router_id  # the same router, with its state: not restarted
        assert st["expected_replicas"] == 2  # static's split and chunked's first round use it

        # The new replica takes work like the first.
        lengths = [100] * 128
        results = collect(client, client.submit(batch(200, lengths)), len(lengths))
        assert [len(c.token_ids) for c in results] == lengths
        assert len({c.replicas[0] for c in results}) == 2

        # Shrink 2 -> 1 while a batch runs on both: Serve stops one replica gracefully; it hands
        # its sequences back with every token, and the other finishes them. The batch must outlast
        # the `serve deploy` CLI, which takes from seconds to over 25 s on a busy 2-core machine:
        # 700 and then 1600 tokens (25 s on both replicas) once finished first.
        lengths = [3000] * 64
        bid = client.submit(batch(300, lengths))
        wait_running_on(client, 2)
        t0 = time.monotonic()
        serve_deploy(cfg_file, serve_config(cluster_config, 1))
        cli_s = time.monotonic() - t0
        results = collect(client, bid, len(lengths))
        assert any(len(set(c.replicas)) == 2 for c in results), (  # resumed where it was handed back
            f"the batch ended on both replicas before the shrink (the serve deploy CLI took {cli_s:.0f} s)")
        assert [len(c.token_ids) for c in results] == lengths
        assert all(c.finish_reason == "length" for c in results)
        st = client.status()
        assert st["router_id"] == router_id
        assert len(st["replicas"]) == 1 and st["expected_replicas"] == 1
        assert st["counters"]["replica_leaves"] == 1 and st["counters"]["replica_deaths"] == 0

        # The same through the driver (Serve's external scaling API): grow 1 -> 2, then shrink
        # 2 -> 1 while a batch runs on both. scale() asks Serve's controller itself (no CLI to
        # start), so the leaving replica hands back within a second or two of the call: 800 tokens
        # (10 s on one free core, longer on a busy one) outlast that by far.
        lengths = [800] * 64
        with pytest.raises(InputError, match="replicas=0: must be an integer >= 1"):
            client.scale(0)
        st = client.scale(2, timeout_s=600)
        assert len(st["replicas"]) == 2 and st["expected_replicas"] == 2 and st["router_id"] == router_id
        bid = client.submit(batch(400, lengths))
        wait_running_on(client, 2)
        st = client.scale(1, timeout_s=600)  # the leave after the target does not lower the count again
        assert len(st["replicas"]) == 1 and st["expected_replicas"] == 1
        results = collect(client, bid, len(lengths))
        assert [len(c.token_ids) for c in results] == lengths
        assert any(len(set(c.replicas)) == 2 for c in results)
        st = client.status()
        assert st["counters"]["replica_leaves"] == 2 and st["counters"]["replica_deaths"] == 0
        assert st["router_id"] == router_id

        # A fleet that is not there in time raises with what Serve says, and leaves the target set:
        # Serve brings the fleet there by itself.
        with pytest.raises(TimeoutError, match=r"scale: the fleet is not at 2 after 1 s: 1 replicas pull from the "
                                               r"router, and Serve's EngineReplica replicas are \{.*'RUNNING': 1.*\}"
                                               r".*The target stays 2"):
            client.scale(2, timeout_s=1)
        assert client.status()["expected_replicas"] == 2  # the router kept the target
        st = client.wait_ready(2, 600)
        assert st["expected_replicas"] == 2 and st["router_id"] == router_id

        # From outside Ray: Serve's REST route on the dashboard, with the cluster's token
        # (k8s/README.md). The router learns the new size from the leave.
        assert rest_scale(1) == 200
        deadline = time.monotonic() + 300
        while len(client.status()["replicas"]) != 1 or client.status()["expected_replicas"] != 1:
            assert time.monotonic() < deadline, client.status()
            time.sleep(0.5)
        # and from the command line, attached to the running app (as a launcher would): at the size
        # it has, it settles at once
        run = subprocess.run([str(VENV_BIN / "rollout-cluster"), "scale", "1", "--app-name", APP, "--timeout-s", "300"],
                             env=ray_env(), capture_output=True, text=True, timeout=400, cwd=ROOT)
        assert run.returncode == 0, run.stderr[-3000:]
        out = json.loads(next(line for line in reversed(run.stdout.splitlines()) if line.startswith("{")))
        assert len(out["replicas"]) == 1 and out["expected_replicas"] == 1
        st = client.status()
        assert len(st["replicas"]) == 1 and st["expected_replicas"] == 1 and st["router_id"] == router_id
        assert st["counters"]["replica_deaths"] == 0
        lengths = [50] * 16
        results = collect(client, client.submit(batch(500, lengths)), len(lengths))
        assert [len(c.token_ids) for c in results] == lengths
    finally:
        serve.delete(APP)


def rest_scale(replicas: int) -> int:
    import urllib.request
    from pathlib import Path

    token = (Path.home() / ".ray" / "auth_token").read_text().strip()
    req = urllib.request.Request(
        f"http://127.0.0.1:8265/api/v1/applications/{APP}/deployments/EngineReplica/scale",
        data=json.dumps({"target_num_replicas": replicas}).encode(), method="POST",
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as answer:
        return answer.status


def test_the_started_app_scales_from_the_driver(client):
    """RolloutClient.start deploys with Serve's external scaler on: scale() to the current size is
    accepted and settles at once; a bad size names the value."""
    st = client.scale(2, timeout_s=120)
    assert len(st["replicas"]) == 2 and st["expected_replicas"] == 2
    for bad in (True, 1.5, -1):
        with pytest.raises(InputError, match="replicas="):
            client.scale(bad)
