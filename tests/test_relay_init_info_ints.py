"""Regression: vLLM's /init_weight_transfer_engine took TRL's `init_info.rank_offset: true` (a
bool) as the integer 1, and `world_size: 2.0` or `rank_offset: 1.0` as 2 and 1 (the relay compared
with `!=`): a field where an integer is meant must be an integer, refused naming the field and the
value (422 in TRL's FastAPI shape, as the neighbouring checks), before the relay joins any group."""
import pytest

from rollout_cluster.transfer.relay import RelayError, WeightRelay
from test_protocols import AUTH, TOKEN, codec, relay_http, router  # noqa: F401 (fixtures)

GOOD = {"master_address": "127.0.0.1", "master_port": 29511, "rank_offset": 1, "world_size": 2}
NOT_INTS = [("rank_offset", True), ("rank_offset", 1.0), ("rank_offset", "1"),
            ("world_size", 2.0), ("world_size", "2"), ("world_size", [2])]


class Commits:
    def __call__(self, named: list) -> int:
        raise AssertionError("nothing may be committed")


@pytest.mark.parametrize("key, value", NOT_INTS)
def test_init_info_rank_offset_true_is_no_integer(key, value):
    relay = WeightRelay({"w": (2,)}, Commits(), "cpu", timeout_s=1)
    with pytest.raises(RelayError) as e:
        relay.open_vllm({**GOOD, key: value})
    assert e.value.field == f"init_info.{key}"
    assert repr(value) in str(e.value) and "integer" in str(e.value)
    assert relay.channel is None  # refused before joining a group


@pytest.mark.parametrize("value", [True, 2.0, "2"])
def test_init_communicator_world_size_must_be_an_integer_called_directly(value):
    relay = WeightRelay({"w": (2,)}, Commits(), "cpu", timeout_s=1)
    with pytest.raises(RelayError) as e:
        relay.check_trl("127.0.0.1", 29511, value)
    assert e.value.field == "world_size" and repr(value) in str(e.value)


@pytest.mark.parametrize("key, value", NOT_INTS[:3] + NOT_INTS[3:4])
def test_init_weight_transfer_engine_refuses_a_bool_rank_offset_with_422(relay_http, key, value):
    http, commits = relay_http
    r = http.post("/init_weight_transfer_engine", headers=AUTH, json={"init_info": {**GOOD, key: value}})
    assert r.status_code == 422, r.text
    detail = r.json()["detail"][0]
    assert detail["loc"] == ["body", f"init_info.{key}"] and repr(value) in detail["msg"]
    assert commits.named == []
