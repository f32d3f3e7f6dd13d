"""push_weights' tensor path at its edges (transfer/buckets.py, staging.py, push.py, client/fleet_ops.py):
what a trainer may hand it, what a replica may be handed, and the checks that come before any work."""
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rollout_cluster.transfer import push as push_mod
from rollout_cluster.transfer.buckets import pack, pack_group, plan, unpack
from rollout_cluster.transfer.staging import Staging


# --- staging: the buffer is sized by bucket_bytes, not by what the bucket holds -------------------

def test_a_large_bucket_bytes_does_not_make_a_small_push_reserve_that_much():
    """One 128-byte transposed tensor, bucket_bytes=1 GiB (a trainer asking for "one bucket for the
    whole model"): the staging buffer became 1.09 GB (and, for a GPU tensor, page-locked whole),
    kept in the process from push to push."""
    stage = Staging(pin=False)
    named = [("w", torch.ones(8, 4).t())]
    (bucket,) = pack(named, bucket_bytes=1 << 30, staging=stage)
    assert torch.equal(unpack(bucket)[0][1], named[0][1])
    assert stage.nbytes < 1 << 20, f"staging buffer of {stage.nbytes} bytes for a 128-byte bucket"
    stage.release()


@pytest.mark.parametrize("way", ["pack", "pack_group"])
def test_a_huge_bucket_bytes_packs_a_small_strided_tensor(way):
    """bucket_bytes=2**50 passes the argument check (an int >= 1), but packing one 128-byte
    transposed tensor raised "DefaultCPUAllocator: can't allocate memory: you tried to allocate
    1143...": the staging buffer is grown to `reserve` = bucket_bytes + 1/64."""
    stage = Staging(pin=False)
    named = [("w", torch.arange(32.0).reshape(8, 4).t())]
    if way == "pack":
        (bucket,) = pack(named, bucket_bytes=1 << 50, staging=stage)
    else:
        (group,) = plan(named, bucket_bytes=1 << 50)
        bucket = pack_group(group, stage, 1 << 50)
    assert torch.equal(unpack(bucket)[0][1], named[0][1])
    stage.release()


# --- the replica's unpack: a bucket whose bytes do not match its header ----------------------------

def test_a_bucket_without_the_bytes_its_header_announces_is_refused_not_loaded_as_garbage():
    """buckets.unpack (the replica's reader, bucket_stream.fetched) turns a tensor whose data is
    empty into torch.empty(shape): a header announcing a 1024x1024 float32 tensor with 0 bytes
    gave 4 MiB of uninitialised memory, which passes BucketCheck (right name, right shape) and is
    loaded as the weight. Every other byte-count mismatch raises (view/reshape)."""
    bucket = {"names": ["w"], "dtypes": ["float32"], "shapes": [[1024, 1024]], "data": [np.zeros(0, np.uint8)]}
    with pytest.raises((ValueError, RuntimeError)):
        got = unpack(bucket)
        pytest.fail(f"unpacked as a {tuple(got[0][1].shape)} tensor from 0 bytes")


# --- plan accepts tensors that pack cannot pack: a streamed push fails after its order ----------

def _fake():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.randn(4, 4)


ODD = {
    "fake": _fake,  # FakeTensor (torch.compile / export tracing): float32, no data
    "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
    "conj": lambda: torch.randn(3, dtype=torch.complex64).conj(),  # a lazy conjugate view
}


@pytest.mark.parametrize("kind", sorted(ODD))
def test_what_plan_accepts_pack_can_pack(kind):
    """_packable's promise: a tensor that cannot be packed is refused as the pair comes, naming it,
    so that a streamed push (plan first) fails before any replica is ordered. These pass plan()
    and then fail inside pack() with a bare torch error (".numpy() is not supported for tensor
    subclasses", "nested reshape cannot ...", "view is not supported for conjugate view
    tensors")."""
    t = ODD[kind]()
    try:
        plan([(kind, t)])
    except (TypeError, ValueError) as e:
        assert f"named_tensors[{kind!r}]" in str(e)
        return
    list(pack([(kind, t)]))  # accepted by plan: must then pack


def test_a_streamed_push_whose_later_tensor_cannot_be_packed_fails_before_its_order(monkeypatch):
    """The consequence: the FakeTensor in bucket 1 (float32, the right shape: a replica's manifest
    check passes it) fails only after push_weights went out with bucket 0, so every replica began
    replacing its weights and must reload them after the trainer's abort."""
    import ray

    from router_support import SIGNER
    from test_push_stream import FakeRef, FakeRouter

    log, puts = [], []

    def put(obj):
        puts.append(obj)
        return FakeRef(len(puts) - 1)

    monkeypatch.setattr(ray, "put", put)
    monkeypatch.setattr(push_mod, "abort", lambda *a, **k: None)
    named = [("a", torch.ones(4, 4)), ("b", _fake())]
    with pytest.raises(Exception):
        push_mod.push(FakeRouter(log), SIGNER, named, None, 64, 5.0, stream=True)
    assert not [e for e in log if e[0] == "push_weights"], f"the order went out before the failure: {log}"


# --- argument checks ---------------------------------------------------------------------------

def test_bucket_bytes_true_is_refused_like_other_non_counts():
    """checked() takes any int >= 1, and bool is an int: bucket_bytes=True packs every tensor in a
    bucket of its own. (protocol.is_int, used for every other count, refuses bools.)"""
    with pytest.raises(ValueError, match=re.escape("bucket_bytes=True")):
        list(pack([("w", torch.ones(2))], bucket_bytes=True))


def test_a_version_that_is_no_int_is_refused_before_the_fleet_is_waited_for_and_the_model_put(monkeypatch):
    """fleet_ops.push_weights checks transport and stream but not `version`: version="3" (or 2.0)
    waits for the fleet's running sequences to end (running="finish"), packs and ray.puts the whole
    model, and only then the router refuses the order (FleetWeights.checked)."""
    import ray

    from router_support import SIGNER
    from rollout_cluster.client import fleet_ops
    from rollout_cluster.protocol import InputError
    from test_push_stream import FakeRef, FakeRouter

    puts, statuses = [], []

    def put(obj):
        puts.append(obj)
        return FakeRef(len(puts) - 1)

    def status():
        statuses.append(1)
        return {"weights": {"version": 0, "replicas": {}, "errors": {}}, "sleep": {"level": 0, "errors": {}},
                "live_sequences": 0, "replicas": [], "expected_replicas": 0}

    monkeypatch.setattr(ray, "put", put)
    client = SimpleNamespace(status=status, router=SimpleNamespace(handle=FakeRouter([]), signer=SIGNER),
                             call_timeout_s=5.0, config=None)
    for bad in ("3", 2.0):
        puts.clear(), statuses.clear()
        with pytest.raises((InputError, TypeError, ValueError), match="version"):
            fleet_ops.push_weights(client, [("w", torch.ones(4))], bad, 1 << 20, 5.0, stream=False)
        assert puts == [] and statuses == []


# --- the replica's spec: a checkpoint's index says which .safetensors files are the model ---------

def test_the_spec_reads_the_files_the_index_names_as_vllm_loads_them(tmp_path):
    """Mistral's repos (Mistral-7B-Instruct-v0.3, Mistral-Nemo, ...) ship the HF shards with their
    model.safetensors.index.json AND consolidated.safetensors (the same weights under Mistral's
    own names). vLLM loads only the files the index names (weight_utils.
    filter_duplicate_safetensors_files); checkpoint_spec read every *.safetensors, so a push of
    the model's HF named_parameters() was refused: "N of the served model's 2N tensors are
    missing, e.g. ['layers.0.attention.wq.weight', ...]"."""
    import json

    from safetensors.torch import save_file

    from rollout_cluster.engines.weight_checks import BucketCheck, checkpoint_spec

    hf = {"model.layers.0.self_attn.q_proj.weight": torch.zeros(4, 4), "model.norm.weight": torch.zeros(4)}
    save_file(hf, str(tmp_path / "model-00001-of-00001.safetensors"))
    save_file({"layers.0.attention.wq.weight": torch.zeros(4, 4), "norm.weight": torch.zeros(4)},
              str(tmp_path / "consolidated.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model-00001-of-00001.safetensors" for n in hf}}))
    spec = checkpoint_spec(str(tmp_path))
    assert spec == {n: tuple(t.shape) for n, t in hf.items()}
    check = BucketCheck(spec)
    check.bucket(list(hf.items()))
    assert check.finish() == 2
