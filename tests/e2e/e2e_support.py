"""One real cluster for every e2e test: `ray start --head` with token auth on, the Serve app of configs/local-cpu.yaml with 2 vLLM-CPU replicas, and a RolloutClient."""
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
METRICS_PORT = 9465
DEFAULT_MAX_TOKENS = 24  # the test cluster's sampling.max_tokens: neither SamplingSpec's 128 nor the config's 256


def ray_env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["RAY_AUTH_MODE"] = "token"  # the job API needs it once `ray start` turned token auth on
    return env


@pytest.fixture(scope="session")
def ray_head():
    env = ray_env()
    # A new app's deployment fails after one failed replica constructor, not Serve's 3 per replica
    # (an engine that cannot start here fails the same way each time: test_cluster's broken app
    # then fails in one try, not three). A deployment that has started is never failed by it.
    env["RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT"] = "1"
    subprocess.run([str(VENV_BIN / "ray"), "stop", "--force"], env=env, capture_output=True)
    # With RAY_AUTH_MODE=token, `ray start` refuses to run without a token: on a fresh machine
    # (no ~/.ray/auth_token) make one first, as the README's steps do.
    token = subprocess.run([str(VENV_BIN / "ray"), "get-auth-token", "--generate"], env=env,
                           capture_output=True, text=True, timeout=120)
    assert token.returncode == 0, token.stdout + token.stderr
    out = subprocess.run([str(VENV_BIN / "ray"), "start", "--head", "--num-cpus", "4", "--dashboard-host", "127.0.0.1",
                          "--disable-usage-stats"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    os.environ["RAY_AUTH_MODE"] = "token"
    yield "auto"
    subprocess.run([str(VENV_BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)


@pytest.fixture(scope="session")
def cluster_config():
    from rollout_cluster.config import PolicyConfig, load_config
    from rollout_cluster.model_maker import make_model
    from rollout_cluster.security.local import ensure_local_secrets

    cfg = load_config(ROOT / "configs" / "local-cpu.yaml")
    make_model(str(ROOT / "models" / "tiny-llama"))  # kept if complete (tokenizer, manifest), else made again
    cfg.router = cfg.router.model_copy(update={"replica_timeout_s": 8.0, "niceness": 0, "stall_timeout_s": 20.0})
    # the tests load checkpoints they write under the temporary folder, and the models
    cfg.security = cfg.security.model_copy(update={"checkpoint_roots": [str(ROOT / "models"), tempfile.gettempdir()]})
    ensure_local_secrets(cfg)
    cfg.metrics = cfg.metrics.model_copy(update={"port": METRICS_PORT})
    cfg.policy = PolicyConfig(name="pull")
    cfg.sampling = cfg.sampling.model_copy(update={"max_tokens": DEFAULT_MAX_TOKENS})  # what lines leave out
    return cfg.validate()


@pytest.fixture(scope="session")
def client(ray_head, cluster_config):
    from rollout_cluster.client.client import RolloutClient

    c = RolloutClient.start(cluster_config, address=ray_head, wait_ready_s=900)
    yield c
    c.shutdown()


@pytest.fixture
def fresh_policy(client):
    """Each test states its policy; the next one starts from `pull`."""
    yield client.set_policy
    client.wait_ready(2, 600)
    client.set_policy("pull")


def collect(client, bid, n):
    """Every completion of batch `bid` (n sequences) by its index; fails on one returned twice."""
    results, cursor, done = [None] * n, 0, False
    deadline = time.monotonic() + 600
    while not done:
        assert time.monotonic() < deadline
        new, cursor, done = client.router.fetch.remote(bid, cursor, 1.0).result(timeout_s=60)
        for c in new:
            assert results[c.index] is None  # never twice
            results[c.index] = c
    return results


def http_request(cfg, path: str = "", data=None, method=None, token: bool = True) -> urllib.request.Request:
    """A request to the app's HTTP route /<app><path>, with the app's bearer token unless `token` is False."""
    from rollout_cluster.security.secrets import read_token

    base = f"http://127.0.0.1:{int(os.environ.get('ROLLOUT_HTTP_PORT', 8000))}/{cfg.app_name}"
    headers = {"Authorization": f"Bearer {read_token(cfg.security)}"} if token else {}
    return urllib.request.Request(base + path, data=data, method=method, headers=headers)


def gateway_url(client) -> str:
    """The app's HTTP base URL on this machine (Serve's proxy, app name included)."""
    return f"http://127.0.0.1:{int(os.environ.get('ROLLOUT_HTTP_PORT', 8000))}/{client.config.app_name}"


@contextmanager
def netrc_token(client, base_url: str, folder: Path):
    """The app's token in a netrc file named by $NETRC while inside: what docs/trainers.md tells a
    TRL user to do (`requests`, TRL's HTTP library, reads it for every call)."""
    from urllib.parse import urlparse

    from rollout_cluster.security.secrets import read_token

    path = folder / "netrc"
    path.write_text(f"machine {urlparse(base_url).hostname} login trl password {read_token(client.config.security)}\n")
    path.chmod(0o600)
    old = os.environ.get("NETRC")
    os.environ["NETRC"] = str(path)
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop("NETRC", None)
        else:
            os.environ["NETRC"] = old
