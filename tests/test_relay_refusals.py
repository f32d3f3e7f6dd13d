"""The weight relay (transfer/relay.py, relay_checks.py) at edges a review found, against
docs/trainers.md, docs/architecture.md and TRL's VLLMClient: a refused /update_weights fails its
whole update (finish commits none of it); a bad init_info address is refused naming
init_info.master_address or init_info.master_port, the body's own fields."""
import pytest
import torch

from rollout_cluster.transfer.channels import CpuSender
from rollout_cluster.transfer.relay import RelayError, WeightRelay
from ports import free_port
from relay_commits import Recorder
from test_protocols import AUTH, announced_while_broadcast, codec, relay_http, router  # noqa: F401 (fixtures)

SPEC = {"a.weight": (4, 3), "b.bias": (5,), "c.weight": (2, 2, 2)}


def vllm_relay(commit, timeout_s=5):
    port = free_port()
    sender = CpuSender("127.0.0.1", port, 2, hosts_store=True, timeout_s=timeout_s)  # the trainer is rank 0
    relay = WeightRelay(SPEC, commit, "cpu", timeout_s=timeout_s)
    relay.open_vllm({"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                     "packed": False})
    return relay, sender


def update_weights(relay, sender, named: dict, shapes=None):
    """As TRL >= 1.11's update_named_params: the /update_weights step and the broadcast at once;
    returns the step's error (or None), the trainer's broadcast bounded by a join timeout."""
    answer, trainer_error = announced_while_broadcast(sender, named, relay.receive_packed, shapes)
    assert trainer_error is None, trainer_error
    return answer if isinstance(answer, Exception) else None


def test_finish_after_a_refused_update_weights_commits_no_half_update():
    """TRL >= 1.11's `with client.weight_update(): for name, p in ...: client.update_named_param(name, p)`
    posts /finish_weight_update in its `finally` when an /update_weights raised (a 422 included).
    docs/architecture.md: "A half update is never committed ... `/finish_weight_update` after a
    failure answers it". A refused (then drained) /update_weights sets no `update_failed`, so
    finish commits the tensors staged before the refusal: the fleet gets a new version holding
    a.weight only while the trainer's update failed."""
    commit = Recorder()
    relay, sender = vllm_relay(commit)
    relay.start()
    assert update_weights(relay, sender, {"a.weight": torch.ones(4, 3)}) is None  # 1st param: received
    refused = update_weights(relay, sender, {"b.bias": torch.ones(6)})  # 2nd param: wrong shape, 422
    assert isinstance(refused, RelayError) and refused.field == "update_info.shapes[0]"
    answer = None
    try:  # the weight_update() context's finally
        answer = relay.finish()
    except Exception:  # noqa: BLE001 - answering the failure is the documented outcome
        pass
    assert commit.commits == [], f"a half update was committed as version {answer}: {commit.commits}"
    relay.close()


@pytest.mark.parametrize("key, value", [("master_port", "5000"), ("master_port", 70000), ("master_port", True),
                                        ("master_address", ""), ("master_address", 5)])
def test_a_bad_init_info_address_is_refused_naming_its_own_field(key, value):
    """/init_weight_transfer_engine's refusals name `init_info.<key>` (check_init_info, and
    tests/test_protocols.py's 422 loc ["body", "init_info.world_size"]); a bad master_port or
    master_address is refused by check_address under "port"/"host", fields its body does not have
    (TRL reads the 422's loc ["body", "port"])."""
    relay = WeightRelay(SPEC, Recorder(), "cpu", timeout_s=2)
    info = {"master_address": "127.0.0.1", "master_port": 5000, "rank_offset": 1, "world_size": 2, key: value}
    with pytest.raises(RelayError) as e:
        relay.open_vllm(info)
    assert e.value.field == f"init_info.{key}", str(e.value)
    assert repr(value) in e.value.message
    assert relay.channel is None


def test_a_bad_init_weight_transfer_engine_port_answers_422_naming_init_info_master_port(relay_http):
    http, commits = relay_http
    r = http.post("/init_weight_transfer_engine", headers=AUTH, json={"init_info": {
        "master_address": "127.0.0.1", "master_port": "5000", "rank_offset": 1, "world_size": 2}})
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body", "init_info.master_port"], r.text
