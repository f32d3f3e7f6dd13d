"""An app that is being deployed when the driver is interrupted is removed, and the Ray job removes
only an app it brought up. (Before: deploy() removed the application only when Serve reported
DEPLOY_FAILED or the wait timed out. A SIGTERM (`ray job stop`: Ray's job supervisor sends SIGTERM, and `ray.init` installs a handler
that turns it into `sys.exit(signum)`) or a Ctrl-C while it waits for the engines to load (the
longest phase: minutes for a 7B model, up to --ready-timeout-s 1800 in k8s/rayjob-rollout.yaml)
unwinds out of deploy() before the job's try/finally and before RolloutClient.start sets
`deployed = True`: nobody called serve.delete, and the replicas kept loading and holding GPUs.)
Ray and Serve are stood in for; nothing starts a cluster."""
import argparse
import types

import pytest
import ray
from ray import serve

from rollout_cluster.config import load_config


class FakeServe:
    """Serve as deploy() sees it: _run registers the app, status says DEPLOYING (engines loading)."""

    def __init__(self, monkeypatch, interrupt: BaseException):
        import ray.serve.api as api

        self.apps = set()
        self.interrupt = interrupt
        monkeypatch.setattr(api, "_run", self.run)
        monkeypatch.setattr(serve, "status", self.status)
        monkeypatch.setattr(serve, "delete", self.apps.discard)
        monkeypatch.setattr("rollout_cluster.serve.deploy.time.sleep", self.sleep)

    def run(self, app, _blocking=False, name="default", **kw):
        self.apps.add(name)

    def status(self):
        from ray.serve.schema import ApplicationStatus

        apps = {n: types.SimpleNamespace(status=ApplicationStatus.DEPLOYING, deployments={}, message="")
                for n in self.apps}
        return types.SimpleNamespace(applications=apps)

    def sleep(self, s):
        raise self.interrupt  # the signal arrives while deploy() waits for the replicas


@pytest.mark.parametrize("interrupt", [SystemExit(15), KeyboardInterrupt()])
def test_deploy_removes_the_app_when_interrupted_while_waiting(monkeypatch, interrupt):
    from rollout_cluster.serve.deploy import deploy

    fake = FakeServe(monkeypatch, interrupt)
    cfg = load_config({"engine": {"kind": "sim"}})
    with pytest.raises(type(interrupt)):
        deploy(object(), cfg, timeout_s=600)
    assert fake.apps == set(), "the half-deployed app was left on the cluster"


def test_ray_job_stop_while_the_engines_load_leaves_no_app(monkeypatch, tmp_path):
    """`ray job stop` during the job's deploy: the job's finally never covers deploy()."""
    from rollout_cluster.jobs import rollout as job

    fake = FakeServe(monkeypatch, SystemExit(15))
    monkeypatch.setattr(ray, "init", lambda **kw: None)
    monkeypatch.setattr(job, "_app_running", lambda name: False)
    monkeypatch.setattr("rollout_cluster.serve.app.build_app", lambda cfg: object())
    monkeypatch.setattr("rollout_cluster.security.local.ensure_local_secrets", lambda cfg: [])
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt_token_ids": [1, 2]}\n')
    a = argparse.Namespace(input=str(src), output=str(tmp_path / "out.jsonl"), config={"engine": {"kind": "sim"}},
                           redeploy=False, keep_app=False, ready_timeout_s=1800.0, model=None)
    with pytest.raises(SystemExit):
        job.run(a)
    assert fake.apps == set(), "ray job stop left the Serve app deploying (and holding its GPUs)"


def test_ctrl_c_during_rolloutclient_start_on_a_running_cluster_leaves_no_app(monkeypatch):
    """`rollout-cluster serve CONFIG --address auto` (or RolloutClient.start(cfg, address=...)),
    Ctrl-C while the engines load: start's `except BaseException` undoes only a Ray it started
    (ray.shutdown merely disconnects from a running cluster: Serve apps outlive the driver) and
    deletes the app only once deploy() returned."""
    from rollout_cluster.client import lifecycle
    from rollout_cluster.client.client import RolloutClient

    fake = FakeServe(monkeypatch, KeyboardInterrupt())
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: None)
    monkeypatch.setattr(ray, "shutdown", lambda: None)  # a driver's disconnect: the app stays
    monkeypatch.setattr(serve, "start", lambda **kw: None)
    monkeypatch.setattr("rollout_cluster.serve.app.build_app", lambda cfg: object())
    monkeypatch.setattr("rollout_cluster.security.local.ensure_local_secrets", lambda cfg: [])
    with pytest.raises(KeyboardInterrupt):
        lifecycle.start(RolloutClient, {"engine": {"kind": "sim"}}, "auto", 600.0, {})
    assert fake.apps == set(), "Ctrl-C during start left the app deploying on the cluster"


def _job_over(monkeypatch, tmp_path, running: bool, **args):
    """The job run against a stand-in Serve on which `rollout` is running (or not); returns the
    apps left afterwards and the configs it deployed."""
    from rollout_cluster.jobs import rollout as job

    apps, built = ({"rollout"} if running else set()), []
    monkeypatch.setattr(ray, "init", lambda **kw: None)
    monkeypatch.setattr(job, "_app_running", lambda name: name in apps)
    monkeypatch.setattr("rollout_cluster.serve.app.build_app", lambda cfg: built.append(cfg) or object())
    monkeypatch.setattr("rollout_cluster.serve.deploy.deploy", lambda app, cfg, timeout_s: apps.add(cfg.app_name))
    monkeypatch.setattr("rollout_cluster.security.local.ensure_local_secrets", lambda cfg: [])
    monkeypatch.setattr(serve, "delete", apps.discard)

    class Client:
        def __init__(self, *a, **kw):
            pass

        def wait_ready(self, n):
            return {}

    monkeypatch.setattr("rollout_cluster.client.client.RolloutClient", Client)
    monkeypatch.setattr("rollout_cluster.client.jsonl.run_jsonl", lambda *a, **kw: {"lines": 1})
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt_token_ids": [1, 2]}\n')
    a = argparse.Namespace(**{**dict(input=str(src), output=str(tmp_path / "out.jsonl"),
                                     config={"engine": {"kind": "sim", "model": "models/tiny-llama"}}, redeploy=False,
                                     keep_app=False, ready_timeout_s=60.0, model=None, weights=None, timeout_s=None,
                                     finish_fraction=None, finish_by="sample"), **args})
    assert job.run(a) == 0
    return apps, built


def test_the_job_deploys_the_model_it_is_given_and_removes_the_app_it_brought_up(monkeypatch, tmp_path):
    apps, built = _job_over(monkeypatch, tmp_path, running=False, model="/srv/models/tiny-llama")
    assert [c.engine.model for c in built] == ["/srv/models/tiny-llama"] and apps == set()


def test_a_service_the_job_redeployed_stays(monkeypatch, tmp_path):
    apps, built = _job_over(monkeypatch, tmp_path, running=True, redeploy=True)
    assert len(built) == 1 and apps == {"rollout"}
    apps, built = _job_over(monkeypatch, tmp_path, running=True)  # used as it is, never torn down
    assert built == [] and apps == {"rollout"}
