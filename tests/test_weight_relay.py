"""The weight relay (transfer/relay.py) over its CPU channel (transfer/channels.py), with real
TCPStores between threads: both protocols' rendezvous roles, vLLM's packed chunking, the commit
once an update is whole, and refusals that name the field."""
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_cluster.transfer.channels import CpuChannel, CpuSender
from rollout_cluster.transfer.relay import RelayError, WeightRelay, packed_chunks
from ports import free_port
from relay_commits import Recorder

SPEC = {"a.weight": (4, 3), "b.bias": (5,), "c.weight": (2, 2, 2)}


def tensors(dtype=torch.float32, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g).to(dtype) for name, shape in SPEC.items()}


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
    assert relay.finish() == 1 and len(commit.commits) == 1  # retried: the same version, no second commit
    relay.start()
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
    (lambda r: r.check_param("nope.weight", "float32", [4, 3]), "name"),
    (lambda r: r.bounds.tensor("a.weight", [3, 4], torch.float32, "update_info.names[0]", "update_info.shapes[0]"),
     "update_info.shapes[0]"),  # the shape is what is wrong, not the name
    (lambda r: r.check_param("a.weight", "float32", [4, -3]), "shape"),  # was "name shape", no field
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


def vllm_relay(commit, timeout_s=20, **kw):
    port = free_port()
    sender = CpuSender("127.0.0.1", port, 2, hosts_store=True, timeout_s=timeout_s)
    relay = WeightRelay(SPEC, commit, "cpu", timeout_s=timeout_s, **kw)
    relay.open_vllm({"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                     "packed": False})
    return relay, sender


def announcement(named: dict) -> dict:
    return {"names": list(named), "dtype_names": [str(x.dtype).removeprefix("torch.") for x in named.values()],
            "shapes": [list(x.shape) for x in named.values()], "packed": False}


def test_a_retried_update_weights_receives_nothing_twice_and_a_retried_finish_answers_the_same_version():
    """Regression: TRL's client retries /update_weights whose answer was lost; the relay
    received its tensors already, and a second receive waited for bytes the trainer never sends
    (until the channel's timeout broke the update). A retried /finish_weight_update answered no
    version."""
    commit = Recorder()
    relay, sender = vllm_relay(commit, timeout_s=3)
    new = tensors(seed=5)
    relay.start()
    for part in ({"a.weight": new["a.weight"]}, {"b.bias": new["b.bias"], "c.weight": new["c.weight"]}):
        t, out = in_thread(lambda: [sender.send(x) for x in part.values()])
        relay.receive_packed(announcement(part))
        t.join(20)
        assert "error" not in out
        relay.receive_packed(announcement(part))  # the retry: answered at once, nothing received
    assert relay.channel.received == sender.sent == 3
    assert relay.finish() == 1 and relay.finish() == 1  # the retry: the same version
    assert len(commit.commits) == 1 and all(torch.equal(commit.commits[0][k], v) for k, v in new.items())
    relay.close()


def test_a_tensor_sent_again_in_an_update_that_is_no_retry_is_received_and_replaces_it():
    commit = Recorder()
    relay, sender = vllm_relay(commit)
    old, new = tensors(seed=1), tensors(seed=2)
    relay.start()
    sends = [({"a.weight": old["a.weight"]}), dict(old), {"a.weight": new["a.weight"]}]  # none repeats the last
    for part in sends:
        t, _ = in_thread(lambda: [sender.send(x) for x in part.values()])
        relay.receive_packed(announcement(part))
        t.join(20)
    assert relay.channel.received == 5 and relay.finish() == 1
    assert torch.equal(commit.commits[0]["a.weight"], new["a.weight"])
    assert torch.equal(commit.commits[0]["c.weight"], old["c.weight"])
    # a new update after the commit: the same announcement again is no retry
    relay.start()
    t, _ = in_thread(lambda: [sender.send(x) for x in new.values()])
    relay.receive_packed(announcement(new))
    t.join(20)
    assert relay.channel.received == 8 and relay.finish() == 2
    relay.close()


def test_trl_legacy_announce_tells_a_retry_from_the_next_request():
    """Regression (with test_protocols' route test): a retried /update_named_param/ queued a
    second receive. A request equal to the last announced one, whose tensor has not arrived,
    is that request retried; once the tensor arrived, the same request is a new one."""
    relay = WeightRelay(SPEC, Recorder(), "cpu", timeout_s=20)
    port = free_port()
    relay.open_trl("0.0.0.0", port, 2)
    sender = CpuSender("127.0.0.1", port, 2, hosts_store=False, timeout_s=20)
    x = torch.ones(5)
    assert relay.announce("receive_param", "b.bias", "torch.float32", [5])
    assert not relay.announce("receive_param", "b.bias", "torch.float32", [5])  # retried before the tensor came
    t, _ = in_thread(sender.send, x)
    relay.receive_param("b.bias", "torch.float32", [5])
    t.join(20)
    assert relay.announce("receive_param", "b.bias", "torch.float32", [5])  # arrived: this one is new
    assert relay.announce("receive_param", "a.weight", "torch.float32", [4, 3])
    relay._arrived("receive_param", "b.bias", "torch.float32", [5])  # a finished step clears only its own
    assert not relay.announce("receive_param", "a.weight", "torch.float32", [4, 3])
    relay.close()


def test_without_a_spec_a_byte_cap_bounds_a_tensor_and_an_update():
    relay = WeightRelay(None, Recorder(), "cpu", timeout_s=5, max_bytes=100)
    assert relay.check_param("w", "float32", [5, 5]) == ([5, 5], torch.float32)  # 100 bytes: fits
    with pytest.raises(RelayError, match=r"^shape: \[10, 10\] of torch.float32 for 'w': 400 bytes, more than .* 100"):
        relay.check_param("w", "float32", [10, 10])
    relay.staged = {"a": torch.zeros(20), "w": torch.zeros(5)}
    relay._check_update_bytes("name", {"w": 20})  # w replaced: 80 + 20
    with pytest.raises(RelayError, match=r"^update_info.names: \['b'\]: this update would hold 104 bytes"):
        relay._check_update_bytes("update_info.names", {"b": 4})


def tiny_config_dir(path, **kw):
    from transformers import LlamaConfig

    LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2, vocab_size=64, **kw).save_pretrained(path)  # config.json, no weights
    return str(path)


def test_without_checkpoint_files_the_config_gives_the_names_and_shapes(tmp_path):
    """Regression: an engine with load_format dummy has no safetensors, and the relay took any
    name and shape a trainer announced (a trainer could make it allocate any size)."""
    from rollout_cluster.engines.weight_checks import served_weights

    served = served_weights(tiny_config_dir(tmp_path / "untied", tie_word_embeddings=False))
    assert served.source == "config" and served.max_bytes is None
    assert served.spec["model.embed_tokens.weight"] == (64, 16) and served.spec["lm_head.weight"] == (64, 16)
    assert served.spec["model.layers.1.mlp.down_proj.weight"] == (16, 32) and len(served.spec) == 2 + 2 * 9 + 1
    tied = served_weights(tiny_config_dir(tmp_path / "tied", tie_word_embeddings=True)).spec
    assert set(served.spec) - set(tied) == {"lm_head.weight"}  # as named_parameters() and the checkpoint hold it
    relay = WeightRelay(served.spec, Recorder(), "cpu")
    with pytest.raises(RelayError, match=r"^shape: \[1000000000000\] for 'model.norm.weight': the served"):
        relay.check_param("model.norm.weight", "float32", [10 ** 12])
    assert served_weights(str(tmp_path / "nothing")).source == "none"


def test_a_config_transformers_cannot_build_falls_back_to_a_cap_from_its_sizes(tmp_path, monkeypatch):
    from rollout_cluster.engines import weight_checks

    def unbuildable(config):
        raise ValueError("no such architecture")

    monkeypatch.setattr(weight_checks, "config_spec", unbuildable)
    served = weight_checks.served_weights(tiny_config_dir(tmp_path / "m", tie_word_embeddings=False))
    assert served.spec is None and served.source == "config estimate"
    params = 2 * 64 * 16 + 2 * (4 * 16 * 16 + 3 * 16 * 32 + 4 * 16)  # >= the model's 7,248 parameters
    assert served.max_bytes == 8 * params


def test_a_retried_finish_whose_commit_failed_fails_again_and_does_not_answer_success():
    """Regression: a commit that failed (the fleet could not load) had already emptied the staged
    tensors, so TRL's retry of a /finish_weight_update whose 409 was lost found nothing staged and
    answered success: the trainer went on as if the fleet held its update."""
    def failing(named: list) -> int:
        raise RuntimeError("replica r1 could not load")

    relay, sender = vllm_relay(failing)
    new = tensors(seed=3)
    relay.start()
    t, _ = in_thread(lambda: [sender.send(x) for x in new.values()])
    relay.receive_packed(announcement(new))
    t.join(20)
    with pytest.raises(RuntimeError, match="r1 could not load"):
        relay.finish()
    with pytest.raises(RuntimeError, match="r1 could not load"):
        relay.finish()  # the retry
    relay.start()  # a new update: its finish is its own
    assert relay.finish() is None
    relay.close()


def test_a_refused_announcement_too_large_to_take_is_refused_at_once_and_says_so():
    """A refused /update_weights is received and dropped so that the trainer's broadcast ends
    (test_protocols.py); a piece larger than any of the served model's is not received (no
    allocation a client chooses), and the answer says the trainer's broadcast will time out."""
    relay, _sender = vllm_relay(Recorder(), timeout_s=3)
    relay.start()
    bound = relay.drain_bound()
    assert bound == relay.buffer_bytes + 8 * 12  # the chunk size plus a.weight's 12 elements at 8 bytes
    huge = {"names": ["a.weight"], "dtype_names": ["float32"], "shapes": [[bound]], "packed": False}
    with pytest.raises(RelayError) as e:
        relay.receive_packed(huge)
    assert e.value.field == "update_info.shapes[0]" and "was not received" in str(e.value)  # the shape is wrong
    assert relay.channel.received == 0
    with pytest.raises(RelayError) as e:  # a shape that is no shape: refused for its form, nothing to take
        relay.receive_packed({"names": ["a.weight"], "dtype_names": ["float32"], "shapes": [[4, -3]]})
    assert e.value.field == "update_info.shapes[0]"
    relay.close()
