"""Two fixes' edges (a review of the day's fixes found them): the Gateway's Hub lookup for a
model's tokenizer is bounded (a Hub that accepts and never answers held its start for ever), and
deploy has one rule for a failed deploy, whichever wait saw it: an app it created is removed, one
that ran before (an update) is left as Serve has it."""
import os
import subprocess
import sys
import textwrap
import types

import pytest

from rollout_cluster.config import load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_text_codec_hub_lookup_is_bounded_when_the_hub_does_not_answer():
    """text/codec.py hub_folder (line ~205, called from TextCodec.load line ~66, which the Gateway
    runs in __serve_build_asgi_app__, serve/gateway.py:272): a model name of the form owner/name
    that is not a folder on the Gateway's node now goes to huggingface_hub.snapshot_download. That
    includes the default engine.model "models/tiny-llama" (and any relative local path) whenever
    the folder is not on the Gateway's node: before, load returned None at once. snapshot_download
    first calls HfApi.repo_info/model_info with no timeout, so a Hub endpoint (or proxy, or
    black-holed egress, cf. k8s/networkpolicy.yaml) that accepts and never answers hangs the
    Gateway's start for ever instead of the documented fallback ("None where the Hub and the cache
    have none ... text prompts are then refused"). Right: the lookup is bounded (a timeout, or no
    Hub call for a name that is a relative local path), and load returns None promptly."""
    script = textwrap.dedent("""
        import os, socket, time
        s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(100)   # accepts, never answers
        os.environ["HF_ENDPOINT"] = "http://127.0.0.1:%d" % s.getsockname()[1]
        from rollout_cluster.text.codec import TextCodec
        t = time.monotonic()
        print("CODEC", TextCodec.load("models/tiny-llama-not-on-this-node"), round(time.monotonic() - t, 1))
    """)
    env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
           "HF_HOME": os.path.join("/tmp", f"review-hf-home-{os.getpid()}"), "ROLLOUT_HUB_TIMEOUT_S": "2"}
    env.pop("HF_HUB_OFFLINE", None)
    try:
        out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=40)
    except subprocess.TimeoutExpired:
        pytest.fail("TextCodec.load('models/tiny-llama-not-on-this-node') still waited on an unanswering Hub "
                    "after 40 s: a Gateway start without a working network hangs")
    assert "CODEC None" in out.stdout, (out.stdout, out.stderr[-2000:])


def test_deploy_keeps_an_existing_app_when_its_update_fails_in_the_wait_as_when_it_fails_in_run(monkeypatch):
    """serve/deploy.py deploy (lines 28-36 vs 37-57): the fix records `existed` ("an update: a
    failed one leaves the app that ran") and does not delete an app that existed when Serve's _run
    fails. But the very same failed update, when it fails one step later (the app goes
    DEPLOY_FAILED, or wait_ready_s runs out, or Ctrl-C in deploy's own wait), still calls
    serve.delete(name) unconditionally: the app that ran, and its drivers, are removed. Whether a
    failed update removes a running application depends on which wait noticed the failure. Right:
    one rule for both (the `existed` check applies to the wait's failure paths too, or neither)."""
    import ray.serve.api as api
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    from rollout_cluster.serve.deploy import deploy

    apps = {"rollout"}  # an app that runs; RolloutClient.start / the rollout job deploys over it

    def run(app, _blocking=False, name="default", **kw):
        apps.add(name)

    def status():
        return types.SimpleNamespace(applications={
            n: types.SimpleNamespace(status=ApplicationStatus.DEPLOY_FAILED, deployments={}, message="boom")
            for n in apps})

    deleted = []
    monkeypatch.setattr(api, "_run", run)
    monkeypatch.setattr(serve, "status", status)
    monkeypatch.setattr(serve, "delete", lambda name: (deleted.append(name), apps.discard(name)))
    cfg = load_config({"engine": {"kind": "sim"}})

    # the same update, failing inside _run: the existing app is kept
    monkeypatch.setattr(api, "_run", lambda *a, **k: (_ for _ in ()).throw(TimeoutError("proxies")))
    with pytest.raises(TimeoutError):
        deploy(object(), cfg, timeout_s=600)
    assert deleted == []

    # ... and failing in deploy's own wait: kept too, and the error says so
    monkeypatch.setattr(api, "_run", run)
    with pytest.raises(RuntimeError, match="left as Serve has it"):
        deploy(object(), cfg, timeout_s=600)
    assert deleted == [], "a failed update of an app that existed removed it (a failure inside _run keeps it)"
    # a new app that fails is removed, whichever wait saw it
    apps.clear()
    with pytest.raises(RuntimeError, match="and was removed"):
        deploy(object(), cfg, timeout_s=600)
    assert deleted == ["rollout"]
