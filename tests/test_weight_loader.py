"""The parts of load_tensors that need no engine: the checkpoint spec, the checks that refuse
tensors by name, the packed form of a bucket, and the simulated engine's load_tensors.
(The real engine's load: tests/e2e/test_load_tensors.py.)"""
import asyncio

import numpy as np
import pytest
import torch

from rollout_cluster.engines.weight_checks import BucketCheck, checkpoint_spec
from rollout_cluster.engines.bucket_files import map_shm, pack_bucket, unpack_bucket, write_bucket
from rollout_cluster.model_maker import make_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("m") / "tiny"))


def test_the_spec_is_every_checkpoint_tensor_with_its_shape_read_from_the_headers(model, tmp_path):
    from safetensors.torch import load_file

    spec = checkpoint_spec(str(model))
    assert spec == {n: tuple(t.shape) for n, t in load_file(str(model / "model.safetensors")).items()}
    assert spec["model.layers.0.mlp.down_proj.weight"] == (128, 256)
    assert checkpoint_spec(str(tmp_path)) is None  # no safetensors: nothing to check against
    assert checkpoint_spec(str(tmp_path / "none")) is None


def test_a_bucket_check_names_the_tensor_it_refuses():
    spec = {"a": (2, 3), "b": (4,)}
    ok = BucketCheck(spec)
    ok.bucket([("a", torch.zeros(2, 3))])
    ok.bucket([("b", np.zeros(4, dtype=np.float32))])
    assert ok.finish() == 2
    cases = [
        ([("c", torch.zeros(1))], r"tensor 'c': the served model has no such weight"),
        ([("a", torch.zeros(3, 2))], r"tensor 'a': shape \(3, 2\), the served model's is \(2, 3\)"),
        ([("a", torch.zeros(2, 3)), ("a", torch.zeros(2, 3))], r"tensor 'a': given twice"),
        ([("b", torch.zeros(4, dtype=torch.int32))], r"tensor 'b': dtype torch.int32 is not floating point"),
    ]
    for bucket, match in cases:
        with pytest.raises(ValueError, match=match):
            BucketCheck(spec).bucket(bucket)
    with pytest.raises(TypeError, match=r"bucket 0: .*each item must be a \(name, tensor\) pair"):
        BucketCheck(spec).bucket([torch.zeros(2)])
    with pytest.raises(TypeError, match=r"bucket 0: dict: a bucket is a list"):
        BucketCheck(spec).bucket({"a": torch.zeros(2, 3)})
    with pytest.raises(TypeError, match=r"tensor 'a': str is not a tensor or an array"):
        BucketCheck(spec).bucket([("a", "weights")])
    partial = BucketCheck(spec)
    partial.bucket([("a", torch.zeros(2, 3))])
    with pytest.raises(ValueError, match=r"1 of the served model's 2 tensors are missing, e.g. \['b'\]"):
        partial.finish()
    with pytest.raises(ValueError, match="no tensor given"):
        BucketCheck(None).finish()


def test_without_a_spec_only_names_and_dtypes_are_checked():
    check = BucketCheck(None)
    check.bucket([("anything", torch.zeros(7))])
    with pytest.raises(ValueError, match="given twice"):
        check.bucket([("anything", torch.zeros(7))])
    assert BucketCheck(None).bucket([("x", torch.zeros(1))]) is None


def test_a_packed_bucket_unpacks_to_the_same_tensors_from_memory_and_from_a_shm_file():
    bucket = [("w", torch.randn(3, 5)), ("h", torch.randn(7).to(torch.bfloat16)), ("s", torch.tensor(2.5)),
              ("t", torch.randn(4, 6).t()), ("e", torch.zeros(0, 3)), ("n", np.arange(6, dtype=np.float16).reshape(2, 3))]
    header, buf = pack_bucket(bucket)
    assert header["nbytes"] == buf.numel() == 5 * 64 + 6 * 2  # each tensor starts at a multiple of 64 bytes
    assert all(off % 64 == 0 for off in header["offsets"])
    header_of_file, path = write_bucket(bucket)
    assert header_of_file == header
    try:
        for got in (unpack_bucket(header, buf), unpack_bucket(header, map_shm(path, header["nbytes"]))):
            assert [n for n, _ in got] == [n for n, _ in bucket]
            for (_, want), (_, t) in zip(bucket, got):
                want = torch.as_tensor(want)
                assert t.dtype == want.dtype and t.shape == want.shape and torch.equal(t, want)
    finally:
        import os

        os.unlink(path)


def test_the_simulated_engine_takes_the_order_and_counts_the_tensors():
    from rollout_cluster.engines.cost_model import CostModel
    from rollout_cluster.engines.sim_engine import SimEngine

    async def go():
        eng = SimEngine(CostModel(name="t", a=1e-3, c=1e-6, e=0.0, prefill_tokens_per_s=1e5, kv_tokens=1000,
                                  max_num_seqs=4))
        await eng.start()
        n = await eng.load_tensors([[("a", torch.zeros(1)), ("b", torch.zeros(1))], [("c", torch.zeros(1))]])

        async def arriving():
            yield [("a", torch.zeros(1))]

        m = await eng.load_tensors(arriving())
        await eng.shutdown()
        return n, m, eng.tensors_loaded

    assert asyncio.run(go()) == (3, 1, 1)


def test_a_bucket_packed_by_the_trainer_unpacks_from_read_only_bytes_without_a_copy():
    """The relay's form: the trainer packs (bfloat16 survives as bytes), the replica gets a
    read-only uint8 array (Ray's object store) and hands the views to load_tensors."""
    import warnings

    bucket = [("a", torch.randn(4, 4).to(torch.bfloat16)), ("b", torch.randn(3))]
    header, buf = pack_bucket(bucket)
    frozen = buf.numpy().copy()
    frozen.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = unpack_bucket(header, frozen)
        assert unpack_bucket(header, frozen.tobytes())[1][1].tolist() == bucket[1][1].tolist()
    assert got[0][1].data_ptr() == frozen.ctypes.data  # a view, not a copy
    assert all(torch.equal(t, want) for (_, t), (_, want) in zip(got, bucket))
    assert unpack_bucket({"names": [], "dtypes": [], "shapes": [], "offsets": [], "nbytes": 0}, b"") == []


def test_a_tied_lm_head_sent_by_state_dict_is_refused_with_the_way_out():
    """A model with tied embeddings (Qwen2.5 up to 3B, Llama 3.2) checkpoints lm_head once, as
    embed_tokens; state_dict() yields it under both names. The refusal says what to send."""
    spec = {"model.embed_tokens.weight": (8, 4), "model.norm.weight": (4,)}
    with pytest.raises(ValueError, match=r"tensor 'lm_head.weight': the served model has no such weight .*; the "
                                         r"served model ties it to 'model.embed_tokens.weight' \(tie_word_embeddings\): "
                                         r"send model.named_parameters\(\)"):
        BucketCheck(spec).bucket([("lm_head.weight", torch.zeros(8, 4))])
    with pytest.raises(ValueError) as e:  # any other unknown name: no hint
        BucketCheck(spec).bucket([("model.extra.weight", torch.zeros(1))])
    assert "ties it" not in str(e.value)
