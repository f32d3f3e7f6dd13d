"""Regressions on how vLLM's trainer sends (transfer/relay.py, receive_packed):
- `packed` was read only from update_info, as bool(): "false" was packed, and vLLM >= 0.28 (and
  TRL >= 1.11 with it) carries it in init_info, where the relay ignored it. It is taken from
  init_info now (update_info overriding where it has one), and only as a JSON boolean.
- A packed chunk holding an odd-sized bfloat16 tensor before a float32 one failed to unpack
  (`view` of a piece at an odd offset). vLLM's packer does not pad (packed_tensor.pack_tensors):
  the relay copies such a piece."""
import threading

import pytest
import torch

from rollout_cluster.transfer.channels import CpuSender
from rollout_cluster.transfer.relay import RelayError, WeightRelay
from ports import free_port
from relay_commits import Recorder


def joined(spec, **init):
    commit, port = Recorder(), free_port()
    sender = CpuSender("127.0.0.1", port, 2, hosts_store=True, timeout_s=5)
    relay = WeightRelay(spec, commit, "cpu", timeout_s=5)
    relay.open_vllm({"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, **init})
    relay.start()
    return relay, sender, commit


def send_and_receive(relay, sender, chunks: list, info: dict) -> None:
    t = threading.Thread(target=lambda: [sender.send(c) for c in chunks])
    t.start()
    relay.receive_packed(info)
    t.join(20)


@pytest.mark.parametrize("init, update", [({"packed": False}, {}), ({"packed": True}, {"packed": False})])
def test_packed_comes_from_init_info_and_update_info_overrides_it(init, update):
    new = {"a": torch.randn(4, 3), "b": torch.randn(5)}
    relay, sender, commit = joined({"a": (4, 3), "b": (5,)}, **init)
    info = {"names": list(new), "dtype_names": ["float32"] * 2, "shapes": [[4, 3], [5]], **update}
    send_and_receive(relay, sender, list(new.values()), info)  # one tensor at a time, as the trainer said
    assert relay.finish() == 1 and all(torch.equal(commit.commits[0][k], v) for k, v in new.items())
    relay.close()


@pytest.mark.parametrize("value", ["false", 0, 1, None])
def test_packed_must_be_a_json_boolean_in_init_info_and_in_update_info(value):
    relay = WeightRelay(None, Recorder(), "cpu", timeout_s=1)
    with pytest.raises(RelayError) as e:
        relay.open_vllm({"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1,
                         "world_size": 2, "packed": value})
    assert e.value.field == "init_info.packed" and repr(value) in str(e.value) and relay.channel is None
    relay, sender, commit = joined({"a": (2,)})
    with pytest.raises(RelayError) as e:
        relay.receive_packed({"names": ["a"], "dtype_names": ["float32"], "shapes": [[2]], "packed": value})
    assert e.value.field == "update_info.packed" and repr(value) in str(e.value)
    assert relay.channel.received == 0
    relay.close()


@pytest.mark.filterwarnings("ignore:Tensor .* exceeds buffer_size_bytes")
def test_a_packed_chunk_of_mixed_dtypes_at_odd_offsets_unpacks_as_vllms_packer_packed_it():
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    new = {"n": torch.randn(3).to(torch.bfloat16), "w": torch.randn(2, 3), "h": torch.randn(1).to(torch.float16),
           "d": torch.randn(2).to(torch.float64)}
    relay, sender, commit = joined({k: tuple(v.shape) for k, v in new.items()})
    items, chunks = iter(new.items()), []
    while (chunk := pack_tensors(items, lambda item: item[1], 1 << 20)) is not None:
        chunks.append(chunk.packed_tensor)
    assert len(chunks) == 1 and chunks[0].numel() == 6 + 24 + 2 + 16  # no padding between them
    info = {"names": list(new), "dtype_names": [str(v.dtype).removeprefix("torch.") for v in new.values()],
            "shapes": [list(v.shape) for v in new.values()]}
    send_and_receive(relay, sender, chunks, info)  # packed: init_info's default, as TRL's
    assert relay.finish() == 1
    for k, v in new.items():
        got = commit.commits[0][k]
        assert got.dtype == v.dtype and torch.equal(got, v), k
    relay.close()
