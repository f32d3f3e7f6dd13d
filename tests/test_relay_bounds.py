"""Regressions on what the relay refuses, and where:
- TRL <= 1.10's /update_named_param/ answered 200 before its background step found no
  communicator open, the update past its byte cap, or an earlier step failed: the trainer
  broadcast into nothing and heard of it later, if at all (and each later step's error wrapped
  the one before). Every check that needs no byte of the tensor now runs before the answer: 422
  naming the field and the value, an earlier failure answered once.
- Without the model's names and shapes (and no estimate) any shape was accepted, [2**40, 2**40]
  too: a tensor and an update are bounded now whatever the model (relay_checks.py).
- init_info.packed_buffer_size_bytes had no upper bound (the relay allocates one chunk at once).
- A negative dimension was refused under "name shape" (no such field), a shape unlike the
  served model's under update_info.names[i]: each is named under its shape's field now."""
import threading
import time

import pytest
import torch
from starlette.testclient import TestClient

from rollout_cluster.config import LimitsConfig
from rollout_cluster.serve.gateway import gateway_app
from rollout_cluster.serve.protocols.batch import ProtocolContext
from rollout_cluster.transfer.channels import CpuSender
from rollout_cluster.transfer.relay import RelayError, WeightRelay
from rollout_cluster.transfer.relay_checks import MAX_PACKED_BUFFER_BYTES, check_init_info
from ports import free_port
from test_protocols import AUTH, TOKEN, Commits, codec, router, vllm_group  # noqa: F401 (fixtures)

HUGE = [1 << 40, 1 << 40]


def app(router, codec, spec, **kw):  # noqa: F811
    from rollout_cluster.serve.protocols.trl_weights import RelayRunner

    commits = Commits()
    runner = RelayRunner(WeightRelay(spec, commits, "cpu", timeout_s=5, **kw))
    ctx = ProtocolContext(router, codec, LimitsConfig(), 5.0, model_name="m", model_root="/m", world_size=1)
    return TestClient(gateway_app(router, {}, 5.0, TOKEN, LimitsConfig(), ctx, runner)), commits, runner


def param(http, name, shape, dtype="torch.float32"):
    return http.post("/update_named_param/", headers=AUTH, json={"name": name, "dtype": dtype, "shape": shape})


def refused(answer, field: str) -> str:
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"][0]
    assert detail["loc"] == ["body", field], detail
    return detail["msg"]


def trl_group(http):
    port = free_port()
    assert http.post("/init_communicator/", headers=AUTH,
                     json={"host": "0.0.0.0", "port": port, "world_size": 2}).status_code == 200
    return CpuSender("127.0.0.1", port, 2, hosts_store=False, timeout_s=5), port


def test_update_named_param_without_a_communicator_is_refused_before_its_answer(router, codec):  # noqa: F811
    http, commits, runner = app(router, codec, {"w": (2,)})
    assert "/init_communicator/" in refused(param(http, "w", [2]), "communicator")
    assert runner.pending["receive_param"] == 0 and runner.relay.error is None  # nothing queued to fail later


def test_update_named_param_past_the_updates_byte_cap_is_refused_before_its_answer(router, codec):  # noqa: F811
    http, commits, runner = app(router, codec, None, max_bytes=40)  # a config estimate: no names, a cap
    sender, _ = trl_group(http)
    assert param(http, "a", [6]).status_code == 200  # 24 bytes
    sender.send(torch.ones(6))
    assert "would hold 48 bytes, more than the bound of 40" in refused(param(http, "b", [6]), "shape")
    assert param(http, "a", [6]).status_code == 200  # a sent again replaces itself: 24 bytes
    sender.send(torch.zeros(6))
    assert http.post("/reset_prefix_cache/", headers=AUTH).status_code == 200
    assert len(commits.named) == 1 and list(commits.named[0]) == ["a"] and torch.equal(commits.named[0]["a"],
                                                                                        torch.zeros(6))


def test_an_earlier_failure_is_answered_by_the_next_update_named_param_once_and_not_nested(router, codec):  # noqa: F811
    http, commits, runner = app(router, codec, {"w": (2,), "b": (2,), "c": (2,)})
    sender, _ = trl_group(http)
    assert param(http, "w", [2]).status_code == 200
    sender.store.set("rollout/weights/0", b"12345")  # the trainer's bytes are not w's
    deadline = time.monotonic() + 10
    while runner.relay.error is None and time.monotonic() < deadline:
        time.sleep(0.02)
    message = refused(param(http, "b", [2]), "update")  # before the answer: the trainer sends nothing
    assert "5 bytes arrived" in message and message.count("earlier step failed") == 1, message
    assert runner.relay.error is None and runner.pending["receive_param"] == 0  # answered once
    assert commits.named == []


def test_without_a_spec_a_huge_shape_is_refused_naming_shape_before_anything_is_allocated(router, codec):  # noqa: F811
    http, commits, runner = app(router, codec, None)  # no names, no estimate
    assert str(HUGE) in refused(param(http, "x", HUGE), "shape")
    relay = runner.relay
    with pytest.raises(RelayError) as e:
        relay.check_param("x", "bfloat16", [1 << 32, 2])  # 16 GiB in one tensor
    assert e.value.field == "shape" and "more than the bound of 8589934592" in e.value.message
    assert relay.check_param("x", "bfloat16", [128256, 8192]) == ([128256, 8192], torch.bfloat16)  # a 70B embedding
    sender = vllm_group(http, timeout_s=5)
    assert http.post("/start_weight_update", headers=AUTH, json={}).status_code == 200
    r = http.post("/update_weights", headers=AUTH, json={"update_info": {
        "names": ["x"], "dtype_names": ["float32"], "shapes": [HUGE]}})
    assert str(HUGE) in refused(r, "update_info.shapes[0]") and "was not received" in r.text
    assert relay.channel.received == 0 and sender.sent == 0


def test_without_a_model_an_updates_bytes_are_bounded_and_with_one_its_weights_pass_whatever_their_size():
    relay = WeightRelay(None, Commits(), "cpu", timeout_s=1, max_update_bytes=60)
    relay.staged = {"a": torch.zeros(10)}
    with pytest.raises(RelayError) as e:
        relay._check_update_bytes("update_info.names", {"b": 40})
    assert e.value.field == "update_info.names" and "would hold 80 bytes, more than the bound of 60" in str(e.value)
    # the served model's names and shapes bound it instead: a weight of the model is never too large
    relay = WeightRelay({"a": (10,), "b": (10,)}, Commits(), "cpu", timeout_s=1, max_update_bytes=60,
                        max_tensor_bytes=16)
    relay.staged = {"a": torch.zeros(10)}
    relay._check_update_bytes("update_info.names", {"b": 40})
    assert relay.bounds.tensor("b", [10], torch.float32, "name", "shape") == 40


@pytest.mark.parametrize("size", [MAX_PACKED_BUFFER_BYTES + 1, 10 ** 30, 0])
def test_packed_buffer_size_bytes_is_bounded(size):
    relay = WeightRelay(None, Commits(), "cpu", timeout_s=1)
    with pytest.raises(RelayError) as e:
        relay.open_vllm({"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
                         "world_size": 2, "packed_buffer_size_bytes": size})
    assert e.value.field == "init_info.packed_buffer_size_bytes" and repr(size) in str(e.value)
    assert relay.channel is None
    info = {"master_address": "x", "master_port": 1, "rank_offset": 1, "world_size": 2,
            "packed_buffer_size_bytes": MAX_PACKED_BUFFER_BYTES}
    assert check_init_info(info).buffer_bytes == MAX_PACKED_BUFFER_BYTES


def test_a_wrong_shape_is_named_under_its_shape_field(router, codec):  # noqa: F811
    http, commits, runner = app(router, codec, {"w": (2, 3), "b": (4,)})
    assert "[2, -3]" in refused(param(http, "w", [2, -3]), "shape")  # was "name shape"
    sender = vllm_group(http, timeout_s=5)
    assert http.post("/start_weight_update", headers=AUTH, json={}).status_code == 200
    t = threading.Thread(target=lambda: [sender.send(x) for x in (torch.zeros(4), torch.zeros(3, 2))])
    t.start()
    r = http.post("/update_weights", headers=AUTH, json={"update_info": {
        "names": ["b", "w"], "dtype_names": ["float32"] * 2, "shapes": [[4], [3, 2]], "packed": False}})
    t.join(20)
    message = refused(r, "update_info.shapes[1]")  # was update_info.names[1]: the name is right
    assert "[3, 2] for 'w'" in message and "[2, 3]" in message
