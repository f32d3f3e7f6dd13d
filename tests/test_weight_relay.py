"""The weight relay (transfer/relay.py) over its CPU channel (transfer/channels.py), with real
TCPStores between threads: both protocols' rendezvous roles, vLLM's packed chunking, the commit
once an update is whole, and refusals that name the field."""
import socket
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_cluster.transfer.channels import CpuChannel, CpuSender
from rollout_cluster.transfer.relay import RelayError, WeightRelay, packed_chunks

SPEC = {"a.weight": (4, 3), "b.bias": (5,), "c.weight": (2, 2, 2)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tensors(dtype=torch.float32, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g).to(dtype) for name, shape in SPEC.items()}


class Recorder:
    def __init__(self):
        self.commits = []

    def __call__(self, named: list) -> int:
        self.commits.append(dict(named))
        return len(self.commits)


def in_thread(fn, *args):
    out = {}

    def run():
        try:
            out["value"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_the_cpu_channel_moves_raw_bytes_in_order_both_ways_of_hosting():
    for trainer_hosts in (True, False):
        port = free_port()
        if trainer_hosts:
            sender = CpuSender("127.0.0.1", port, 2, hosts_store=True, timeout_s=20)
            channel = CpuChannel("127.0.0.1", port, 2, hosts_store=False, timeout_s=20)
        else:
            channel = CpuChannel("127.0.0.1", port, 2, hosts_store=True, timeout_s=20)
            sender = CpuSender("127.0.0.1", port, 2, hosts_store=False, timeout_s=20)
        sent = [torch.randn(3, 4).to(torch.bfloat16), torch.arange(6, dtype=torch.float32).reshape(2, 3),
                torch.empty(0, 5)]
        t, _ = in_thread(lambda: [sender.send(x) for x in sent])
        got = [channel.receive(list(x.shape), x.dtype) for x in sent]
        t.join(20)
        for a, b in zip(sent, got):
            assert b.dtype == a.dtype and b.shape == a.shape and torch.equal(a, b)
        assert channel.received == sender.sent == 3


def test_a_tensor_of_another_size_than_announced_is_refused_naming_both():
    port = free_port()
    sender = CpuSender("127.0.0.1", port, 2, hosts_store=True, timeout_s=20)
    channel = CpuChannel("127.0.0.1", port, 2, hosts_store=False, timeout_s=20)
    t, _ = in_thread(sender.store.set, "rollout/weights/0", b"12345")
    t.join(20)
    with pytest.raises(ValueError, match=r"tensor 0: 5 bytes arrived, 48 announced \(shape \[3, 4\]"):
        channel.receive([3, 4], torch.float32)


@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=30), st.integers(1, 700))
def test_packed_chunks_cut_where_vllms_packer_cuts(sizes, buffer_bytes):
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    items = iter([(f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate(sizes)])
    theirs = []
    while (chunk := pack_tensors(items, lambda item: item[1], buffer_bytes)) is not None:
        theirs.append([int(name[1:]) for name in chunk.names])
    assert packed_chunks(sizes, buffer_bytes) == theirs


def test_trl_legacy_protocol_commits_once_every_checkpoint_tensor_arrived():
    commit = Recorder()
    relay = WeightRelay(SPEC, commit, "cpu", timeout_s=20)
    port = free_port()
    relay.open_trl("0.0.0.0", port, 2)  # the relay is rank 0 and hosts; TRL's client joins as rank 1
    sender = CpuSender("127.0.0.1", port, 2, hosts_store=False, timeout_s=20)
    new = tensors(torch.bfloat16)
    t, _ = in_thread(lambda: [sender.send(x) for x in new.values()])
    versions = [relay.receive_param(name, str(x.dtype), list(x.shape)) for name, x in new.items()]
    t.join(20)
    assert versions == [None, None, 1]  # the last tensor completes the checkpoint: one commit
    assert len(commit.commits) == 1 and all(torch.equal(commit.commits[0][k], v) for k, v in new.items())
    assert relay.settle() is None and relay.staged == {}  # nothing left for /reset_prefix_cache/
    relay.close()
    assert relay.channel is None


def test_without_a_spec_trl_legacy_commits_at_settle():
    commit = Recorder()
    relay = WeightRelay(None, commit, "cpu", timeout_s=20)
    port = free_port()
    relay.open_trl("0.0.0.0", port, 2)
    sender = CpuSender("127.0.0.1", port, 2, hosts_store=False, timeout_s=20)
    x = torch.ones(2, 3)
    t, _ = in_thread(sender.send, x)
    assert relay.receive_param("w", "torch.float32", [2, 3]) is None
    t.join(20)
    assert relay.settle() == 1 and torch.equal(commit.commits[0]["w"], x)


@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")
def test_vllm_protocol_receives_packed_chunks_and_commits_at_finish():
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    commit = Recorder()
    relay = WeightRelay(SPEC, commit, "cpu", timeout_s=20)
    port = free_port()
    sender = CpuSender("127.0.0.1", port, 2, hosts_store=True, timeout_s=20)  # the trainer is rank 0
    relay.open_vllm({"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                     "packed": True, "packed_buffer_size_bytes": 40})
    relay.start()
    new = tensors(torch.float32, seed=3)

    def trainer():
        items = iter(new.items())
        while (chunk := pack_tensors(items, lambda item: item[1], 40)) is not None:
            sender.send(chunk.packed_tensor)

    t, out = in_thread(trainer)
    relay.receive_packed({"names": list(new), "dtype_names": ["float32"] * 3,
                          "shapes": [list(x.shape) for x in new.values()], "packed": True})
    t.join(20)
    assert "error" not in out and sender.sent == 2  # 48 bytes pass 40: a chunk; then 20 + 32 pass it: another
    assert relay.finish() == 1
    assert all(torch.equal(commit.commits[0][k], v) for k, v in new.items())
    assert relay.finish() is None  # an empty update commits nothing


@pytest.mark.parametrize("call, field", [
    (lambda r: r.open_trl("0.0.0.0", free_port(), 3), "world_size"),
    (lambda r: r.open_trl("", 1234, 2), "host"),
    (lambda r: r.open_trl("0.0.0.0", 70000, 2), "port"),
    (lambda r: r.open_vllm({"master_address": "x", "master_port": 1, "world_size": 2}), "init_info.rank_offset"),
    (lambda r: r.open_vllm({"master_address": "x", "master_port": 1, "rank_offset": 1, "world_size": 4}),
     "init_info.world_size"),
    (lambda r: r.open_vllm([1]), "init_info"),
    (lambda r: r.receive_param("a.weight", "float32", [4, 3]), "communicator"),
    (lambda r: r.start(), "communicator"),
    (lambda r: r.check_tensor("nope.weight", [4, 3], "name"), "name"),
    (lambda r: r.check_tensor("a.weight", [3, 4], "name"), "name"),
    (lambda r: r.check_tensor("a.weight", [4, -3], "name"), "name shape"),
])
def test_refusals_name_the_field(call, field):
    relay = WeightRelay(SPEC, Recorder(), "cpu", timeout_s=5)
    with pytest.raises(RelayError) as e:
        call(relay)
    assert e.value.field == field and str(e.value).startswith(field + ":")


def test_dtypes_must_be_floating_point_in_either_spelling():
    from rollout_cluster.transfer.relay import torch_dtype

    assert torch_dtype("dtype", "torch.bfloat16") is torch.bfloat16 and torch_dtype("dtype", "float16") is torch.float16
    for bad in ("int64", "torch.bool", "floaty", 3):
        with pytest.raises(RelayError, match=r"^dtype: "):
            torch_dtype("dtype", bad)


def test_an_update_for_another_protocol_is_refused_and_a_background_failure_surfaces_once():
    relay = WeightRelay(SPEC, Recorder(), "cpu", timeout_s=5)
    relay.open_trl("0.0.0.0", free_port(), 2)
    with pytest.raises(RelayError, match="init_weight_transfer_engine"):
        relay.start()
    relay.error = "receive_param: timed out"
    with pytest.raises(RelayError, match="an earlier step failed: receive_param: timed out"):
        relay.settle()
    assert relay.settle() is None  # raised once, then cleared
    relay.close()
