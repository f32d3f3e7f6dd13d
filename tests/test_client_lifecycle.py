"""RolloutClient.start cleans up after itself: a start that fails leaves no app deployed and no
Ray it started, and a client never ends a Ray that its caller started. Ray's and Serve's entry
points are stood in for here (the real start is the e2e suite's `client` fixture)."""
import pytest
import ray
from ray import serve

from rollout_cluster.client import lifecycle
from rollout_cluster.config import ClusterConfig


class Cluster:
    """What start touches: whether this process is connected to Ray, and the apps Serve runs."""

    def __init__(self, monkeypatch, connected: bool = False, deploy_fails: bool = False):
        self.connected, self.apps, self.inits, self.shutdowns = connected, set(), 0, 0
        self.deploy_fails = deploy_fails
        monkeypatch.setattr(ray, "is_initialized", lambda: self.connected)
        monkeypatch.setattr(ray, "init", self.init)
        monkeypatch.setattr(ray, "shutdown", self.shutdown)
        monkeypatch.setattr(serve, "start", lambda **kw: None)
        monkeypatch.setattr(serve, "delete", self.apps.discard)
        monkeypatch.setattr("rollout_cluster.serve.deploy.deploy", self.deploy)
        monkeypatch.setattr("rollout_cluster.serve.app.build_app", lambda cfg: cfg.app_name)
        monkeypatch.setattr("rollout_cluster.security.local.ensure_local_secrets", lambda cfg: [])

    def init(self, **kw):
        self.connected, self.inits = True, self.inits + 1

    def shutdown(self):
        self.connected, self.shutdowns = False, self.shutdowns + 1

    def deploy(self, app, cfg, timeout_s):
        if self.deploy_fails:  # serve/deploy.py removes the app it could not bring up
            raise TimeoutError(f"Serve application {app!r} was not running after {timeout_s:.0f} s, and was removed")
        self.apps.add(app)


def client_class(ready_error=None):
    class Client:
        def __init__(self, app_name, config=None, owns_cluster=False):
            self.app_name, self.config, self.owns_cluster = app_name, config, owns_cluster

        def wait_ready(self, replicas, timeout_s):
            if ready_error is not None:
                raise ready_error
    return Client


@pytest.mark.parametrize("error", [TimeoutError("1 of 2 replicas pulling after 5 s"), KeyboardInterrupt()],
                         ids=["timeout", "ctrl-c"])
def test_a_start_that_fails_leaves_no_app_and_no_ray_it_started(monkeypatch, error):
    """Regression: a start whose replicas never came to pull (or that the caller interrupted)
    raised with the app still deployed, and with the Ray it had started still running in the
    caller's process; a deploy that failed left that Ray too."""
    cluster = Cluster(monkeypatch)
    with pytest.raises(type(error)):
        lifecycle.start(client_class(error), ClusterConfig(), None, 5.0, {})
    assert cluster.apps == set() and not cluster.connected and cluster.shutdowns == 1
    cluster = Cluster(monkeypatch, deploy_fails=True)
    with pytest.raises(TimeoutError, match="was removed"):
        lifecycle.start(client_class(), ClusterConfig(), None, 5.0, {})
    assert cluster.apps == set() and not cluster.connected


def test_a_client_never_ends_the_ray_its_caller_started(monkeypatch):
    """Regression: start without an address took the cluster for its own even when the caller had
    called ray.init() already (a trainer with its own actors on a local Ray): shutdown() then
    ended the caller's Ray, and a failed start would too. Only a Ray that start connected is
    its to end."""
    cluster = Cluster(monkeypatch, connected=True)
    client = lifecycle.start(client_class(), ClusterConfig(), None, 5.0, {})
    assert not client.owns_cluster and cluster.inits == 0
    lifecycle.shutdown(client)
    assert cluster.connected and cluster.shutdowns == 0 and cluster.apps == set()
    with pytest.raises(TimeoutError):
        lifecycle.start(client_class(TimeoutError("not ready")), ClusterConfig(), None, 5.0, {})
    assert cluster.connected and cluster.shutdowns == 0 and cluster.apps == set()
    cluster = Cluster(monkeypatch)  # a Ray that start connected (a local one, or at an address) is its own
    client = lifecycle.start(client_class(), ClusterConfig(), "auto", 5.0, {})
    assert client.owns_cluster and cluster.apps == {"rollout"}
    lifecycle.shutdown(client)
    assert not cluster.connected and cluster.apps == set()


@pytest.mark.parametrize("wait_s", [float("nan"), float("inf"), -1.0, "5", True, None])
def test_connect_refuses_a_wait_that_is_not_a_finite_number_of_seconds(monkeypatch, wait_s):
    """Regression: RolloutClient.connect(wait_s=nan) never returned (no time is past a NaN
    deadline): a wait that is not a finite number >= 0 is refused, naming the field, before Ray."""
    from rollout_cluster.client.client import RolloutClient
    from rollout_cluster.protocol import InputError

    cluster = Cluster(monkeypatch)
    with pytest.raises(InputError, match=r"wait_s=.*must be a finite number of seconds >= 0"):
        RolloutClient.connect("rollout", wait_s=wait_s)
    assert cluster.inits == 0


def test_the_ray_job_deletes_the_app_it_deployed_when_its_client_cannot_be_made(monkeypatch, tmp_path):
    """Regression: the Ray job (jobs/rollout.py) made its RolloutClient after deploying and before
    its try/finally: a client that failed to construct (no control key to sign with, Serve's
    handle not found) left the app it had just deployed running."""
    from rollout_cluster.client.client import RolloutClient
    from rollout_cluster.jobs import rollout as job

    cluster = Cluster(monkeypatch)
    monkeypatch.setattr(job, "_app_running", lambda name: False)

    def broken(self, *args, **kw):
        raise ValueError("no control key configured")
    monkeypatch.setattr(RolloutClient, "__init__", broken)
    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt_token_ids": [1, 2]}\n')
    with pytest.raises(ValueError, match="no control key"):
        job.run(job.argparse.Namespace(input=str(src), output=str(tmp_path / "out.jsonl"), config={}, redeploy=False,
                                       keep_app=False, ready_timeout_s=5.0))
    assert cluster.inits == 1 and cluster.apps == set()
