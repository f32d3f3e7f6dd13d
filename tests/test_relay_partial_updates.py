"""Regressions: a half update reached the fleet.
- A new init (a restarted trainer's) closed the old group through close(), which commits what
  TRL <= 1.10 left staged: the dead trainer's half update was committed. It is dropped now, and
  the log and /weight_info's relay status say so.
- An /update_weights whose receive failed left the tensors received before the failure staged,
  and /finish_weight_update committed them. finish now answers that failure, commits nothing,
  and drops them."""
import logging
import threading

import pytest
import torch

from rollout_cluster.transfer.channels import CpuSender
from rollout_cluster.transfer.relay import RelayError, WeightRelay
from ports import free_port
from relay_commits import Recorder

SPEC = {"a.weight": (4, 3), "b.bias": (5,), "c.weight": (2, 2, 2)}


def test_a_new_init_drops_the_half_update_a_dead_trainer_left_and_says_so(caplog):
    commit = Recorder()
    relay = WeightRelay(SPEC, commit, "cpu", timeout_s=20)
    port = free_port()
    relay.open_trl("0.0.0.0", port, 2)
    sender = CpuSender("127.0.0.1", port, 2, hosts_store=False, timeout_s=20)
    t = threading.Thread(target=sender.send, args=(torch.ones(4, 3),))
    t.start()
    assert relay.receive_param("a.weight", "torch.float32", [4, 3]) is None  # 1 of 3: the trainer dies here
    t.join(20)
    with caplog.at_level(logging.WARNING, logger="rollout_cluster.transfer.relay"):
        relay.open_trl("0.0.0.0", free_port(), 2)  # the restarted trainer
    assert commit.commits == [] and relay.staged == {}
    assert "a.weight" in relay.describe()["dropped"] and "new init" in relay.describe()["dropped"]
    assert "dropped, not committed" in caplog.text
    relay.close()
    assert commit.commits == []


def test_close_communicator_still_commits_what_trl_sent():
    """/close_communicator/ is the trainer's own word that its update is whole: unchanged."""
    commit = Recorder()
    relay = WeightRelay(None, commit, "cpu", timeout_s=20)
    port = free_port()
    relay.open_trl("0.0.0.0", port, 2)
    sender = CpuSender("127.0.0.1", port, 2, hosts_store=False, timeout_s=20)
    t = threading.Thread(target=sender.send, args=(torch.ones(2),))
    t.start()
    relay.receive_param("w", "torch.float32", [2])
    t.join(20)
    assert relay.close() == 1 and list(commit.commits[0]) == ["w"]


def test_finish_after_a_failed_update_weights_commits_nothing_and_names_the_failure():
    commit = Recorder()
    port = free_port()
    sender = CpuSender("127.0.0.1", port, 2, hosts_store=True, timeout_s=20)
    relay = WeightRelay(SPEC, commit, "cpu", timeout_s=5)
    relay.open_vllm({"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                     "packed": False})
    relay.start()

    def trainer():  # a.weight arrives whole; b.bias's bytes are cut short
        sender.send(torch.ones(4, 3))
        sender.store.set("rollout/weights/1", b"12345")

    t = threading.Thread(target=trainer)
    t.start()
    info = {"names": ["a.weight", "b.bias"], "dtype_names": ["float32"] * 2, "shapes": [[4, 3], [5]]}
    with pytest.raises(ValueError, match="5 bytes arrived"):
        relay.receive_packed(info)
    t.join(20)
    assert relay.staged == {} and "a.weight" in relay.describe()["dropped"]
    for _ in range(2):  # TRL's weight_update() posts finish after the failure; and a retry of it
        with pytest.raises(RelayError) as e:
            relay.finish()
        assert e.value.field == "update" and "5 bytes arrived" in e.value.message
        assert "nothing was committed" in e.value.message
    assert commit.commits == []
    relay.start()  # a new update: its finish is its own
    assert relay.finish() is None and commit.commits == []
    relay.close()
