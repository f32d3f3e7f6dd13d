"""Regression: a relay step that never returned (an NCCL receive has no timeout: a trainer that
died mid-broadcast) left the relay stuck for good. Its steps ran on one thread and the routes
waited on them without a bound, so a restarted trainer's init and every /reset_prefix_cache/
queued behind the stuck receive until the Gateway restarted. Now the runner's watchdog gives a
step up past its bound: the route answers naming what timed out, the stuck thread is abandoned
(whatever it does later is dropped), and a fresh worker runs the next init.

A real NCCL hang cannot be made on CPU: the stuck communicator is a channel whose receive
blocks until the test lets it go."""
import threading
import time

import pytest
import torch
from starlette.testclient import TestClient

from rollout_cluster.config import LimitsConfig
from rollout_cluster.serve.gateway import gateway_app
from rollout_cluster.serve.protocols.batch import ProtocolContext
from rollout_cluster.transfer import relay as relay_module
from rollout_cluster.transfer.channels import CpuSender
from ports import free_port
from test_protocols import AUTH, TOKEN, Commits, codec, router  # noqa: F401 (fixtures)

SPEC = {"w.weight": (2, 3), "b.bias": (4,)}
TIMEOUT_S = 0.5  # the relay's bound on one wait


class HungChannel:
    """A communicator whose receive never returns (until `release`), as NCCL's when its peer died."""

    backend = "cpu"

    def __init__(self):
        self.release = threading.Event()
        self.receiving = threading.Event()
        self.fails = False  # once released: raise (NCCL's error at last) rather than return
        self.aborted = threading.Event()  # the relay gave it up (an abort that does not end the wait)

    def receive(self, shape, dtype):
        self.receiving.set()
        self.release.wait(60)
        if self.fails:
            raise RuntimeError("NCCL error: remote process exited")
        return torch.zeros(shape, dtype=dtype)

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        self.aborted.set()


@pytest.fixture
def hung(monkeypatch):
    """open_channel gives the hung channel first, real ones after (a restarted trainer's)."""
    channel, real = HungChannel(), relay_module.open_channel
    opened = []

    def open_channel(*args):
        opened.append(args)
        return channel if len(opened) == 1 else real(*args)

    monkeypatch.setattr(relay_module, "open_channel", open_channel)
    yield channel
    channel.release.set()  # the abandoned thread returns: what it did must be dropped


@pytest.fixture
def relay_app(router, codec):  # noqa: F811
    from rollout_cluster.serve.protocols.trl_weights import RelayRunner

    commits = Commits()
    runner = RelayRunner(relay_module.WeightRelay(SPEC, commits, "cpu", timeout_s=TIMEOUT_S))
    runner.grace_s, runner.poll_s = 0.2, 0.05
    ctx = ProtocolContext(router, codec, LimitsConfig(), 5.0, model_name="m", model_root="/m", world_size=1)
    return TestClient(gateway_app(router, {}, 5.0, TOKEN, LimitsConfig(), ctx, runner)), commits, runner


def within(seconds: float, fn, *args, **kw):
    """fn's answer, failing (not hanging) the test where it takes longer than `seconds`."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("value", fn(*args, **kw)), daemon=True)
    t.start()
    t.join(seconds)
    assert "value" in out, f"no answer within {seconds} s: the relay is stuck"
    return out["value"]


def stuck(hung, runner) -> None:
    """The hung receive has begun (its wait bounded by TIMEOUT_S); the groups after it get a
    timeout a loaded machine cannot miss."""
    assert hung.receiving.wait(5)
    runner.relay.timeout_s = 20


def trl_update(http, sender, new: dict) -> None:
    for name, t in new.items():
        r = http.post("/update_named_param/", headers=AUTH, json={"name": name, "dtype": str(t.dtype),
                                                                 "shape": list(t.shape)})
        assert r.status_code == 200, r.text
        sender.send(t)


def test_a_stuck_trl_receive_is_given_up_and_a_restarted_trainers_init_works(relay_app, hung):
    http, commits, runner = relay_app
    r = http.post("/init_communicator/", headers=AUTH, json={"host": "0.0.0.0", "port": free_port(), "world_size": 2})
    assert r.status_code == 200, r.text
    r = http.post("/update_named_param/", headers=AUTH, json={"name": "w.weight", "dtype": "torch.float32",
                                                             "shape": [2, 3]})
    assert r.status_code == 200  # the trainer died: its tensor never comes
    stuck(hung, runner)
    # /reset_prefix_cache/ waits for the relay: answered, naming what timed out, not queued for ever
    r = within(10, http.post, "/reset_prefix_cache/", headers=AUTH)
    assert r.status_code == 409 and "receive_param waited more than 0.5 s for tensor 'w.weight'" in r.text, r.text
    assert runner.abandoned == 1 and "tensor 'w.weight'" in runner.relay.describe()["given_up"]
    assert hung.aborted.wait(5)  # NCCL's abort would end the stuck kernel
    # the restarted trainer joins again, and its update reaches the fleet
    port = free_port()
    r = http.post("/init_communicator/", headers=AUTH, json={"host": "0.0.0.0", "port": port, "world_size": 2})
    assert r.status_code == 200, r.text
    sender = CpuSender("127.0.0.1", port, 2, hosts_store=False, timeout_s=20)
    new = {"w.weight": torch.randn(2, 3), "b.bias": torch.randn(4)}
    trl_update(http, sender, new)
    r = within(20, http.post, "/reset_prefix_cache/", headers=AUTH)
    assert r.status_code == 200, r.text
    assert len(commits.named) == 1 and all(torch.equal(commits.named[0][k], v) for k, v in new.items())
    hung.release.set()  # the abandoned receive returns at last: nothing of it is staged or committed
    time.sleep(0.3)
    assert runner.relay.staged == {} and len(commits.named) == 1


def test_an_init_queued_behind_a_stuck_receive_runs_once_it_is_given_up(relay_app, hung):
    http, commits, runner = relay_app
    http.post("/init_communicator/", headers=AUTH, json={"host": "0.0.0.0", "port": free_port(), "world_size": 2})
    http.post("/update_named_param/", headers=AUTH, json={"name": "b.bias", "dtype": "torch.float32", "shape": [4]})
    stuck(hung, runner)
    port = free_port()  # the restarted trainer's init comes while the dead one's receive still hangs
    r = http.post("/init_communicator/", headers=AUTH, json={"host": "0.0.0.0", "port": port, "world_size": 2})
    assert r.status_code == 200, r.text
    sender = CpuSender("127.0.0.1", port, 2, hosts_store=False, timeout_s=20)  # joins once the relay hosts
    new = {"w.weight": torch.randn(2, 3), "b.bias": torch.randn(4)}
    trl_update(http, sender, new)
    r = within(20, http.post, "/reset_prefix_cache/", headers=AUTH)
    assert r.status_code == 200, r.text
    assert len(commits.named) == 1 and all(torch.equal(commits.named[0][k], v) for k, v in new.items())


def test_a_stuck_update_weights_answers_504_naming_what_timed_out_and_a_new_init_works(relay_app, hung):
    from test_protocols import vllm_group

    http, commits, runner = relay_app
    info = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2}
    assert http.post("/init_weight_transfer_engine", headers=AUTH, json={"init_info": info}).status_code == 200
    assert http.post("/start_weight_update", headers=AUTH, json={}).status_code == 200
    update = {"names": ["w.weight"], "dtype_names": ["float32"], "shapes": [[2, 3]]}
    t0 = time.monotonic()
    threading.Timer(0.1, stuck, (hung, runner)).start()
    r = within(10, http.post, "/update_weights", headers=AUTH, json={"update_info": update})
    assert r.status_code == 504 and "receive_packed waited more than 0.5 s for packed chunk 0" in r.text, r.text
    assert time.monotonic() - t0 < TIMEOUT_S + runner.grace_s + 2
    r = http.post("/finish_weight_update", headers=AUTH, json={})  # the group is gone: nothing to commit
    assert r.status_code == 422 and "given up" in r.text and commits.named == []
    sender = vllm_group(http, timeout_s=20)  # the trainer initializes again
    assert http.post("/start_weight_update", headers=AUTH, json={}).status_code == 200
    new = {"w.weight": torch.randn(2, 3), "b.bias": torch.randn(4)}
    t = threading.Thread(target=lambda: [sender.send(x) for x in new.values()])
    t.start()
    info = {"names": list(new), "dtype_names": ["float32"] * 2, "shapes": [[2, 3], [4]], "packed": False}
    assert http.post("/update_weights", headers=AUTH, json={"update_info": info}).status_code == 200
    t.join(20)
    assert http.post("/finish_weight_update", headers=AUTH, json={}).json()["version"] == 1
    hung.release.set()
    time.sleep(0.3)  # the abandoned receive returned: its tensor is no one's
    assert runner.relay.staged == {} and len(commits.named) == 1
    assert all(torch.equal(commits.named[0][k], v) for k, v in new.items())


def test_the_watchdog_bounds_the_fleets_commit_by_its_own_timeout(relay_app, hung):
    """A wait says its own bound: the fleet's commit (a push) may take commit_timeout_s, not the
    tensor's timeout_s, before it counts as stuck."""
    http, commits, runner = relay_app
    relay = runner.relay
    release = threading.Event()
    relay.commit_fn, relay.commit_timeout_s = lambda named: release.wait(30) and 7, 2 * TIMEOUT_S
    relay.staged, relay.protocol, relay.channel = {"b.bias": torch.zeros(4)}, "trl", hung
    t0 = time.monotonic()
    r = within(10, http.post, "/reset_prefix_cache/", headers=AUTH)
    took = time.monotonic() - t0
    assert r.status_code == 409 and "waited more than 1 s for the fleet's commit of 1 tensors" in r.text, r.text
    assert 2 * TIMEOUT_S <= took, took
    release.set()


@pytest.mark.parametrize("fails", [False, True], ids=["returns", "raises"])
def test_what_an_abandoned_receive_does_when_it_ends_leaves_the_new_group_alone(relay_app, hung, fails):
    http, commits, runner = relay_app
    hung.fails = fails
    http.post("/init_communicator/", headers=AUTH, json={"host": "0.0.0.0", "port": free_port(), "world_size": 2})
    http.post("/update_named_param/", headers=AUTH, json={"name": "w.weight", "dtype": "torch.float32",
                                                         "shape": [2, 3]})
    stuck(hung, runner)
    assert within(10, http.post, "/reset_prefix_cache/", headers=AUTH).status_code == 409
    port = free_port()
    assert http.post("/init_communicator/", headers=AUTH,
                     json={"host": "0.0.0.0", "port": port, "world_size": 2}).status_code == 200
    sender = CpuSender("127.0.0.1", port, 2, hosts_store=False, timeout_s=20)
    new = {"w.weight": torch.randn(2, 3), "b.bias": torch.randn(4)}
    trl_update(http, sender, {"w.weight": new["w.weight"]})  # half of the new update is staged
    deadline = time.monotonic() + 10
    while "w.weight" not in runner.relay.staged and time.monotonic() < deadline:
        time.sleep(0.02)
    channel = runner.relay.channel
    hung.release.set()  # the dead trainer's receive ends now (its tensor, or NCCL's error)
    time.sleep(0.3)
    assert runner.relay.channel is channel and list(runner.relay.staged) == ["w.weight"]
    assert runner.relay.error is None and runner.relay.dropped is None
    trl_update(http, sender, {"b.bias": new["b.bias"]})
    assert within(20, http.post, "/reset_prefix_cache/", headers=AUTH).status_code == 200
    assert len(commits.named) == 1 and all(torch.equal(commits.named[0][k], v) for k, v in new.items())
