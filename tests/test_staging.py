"""The trainer's staging buffer (transfer/staging.py): tensors that need a copy to host memory go
through one reused buffer, bucket after bucket, and come back exactly; contiguous CPU tensors are
viewed as before; the buffer grows for a large tensor; refused pinned memory falls back to
pageable memory. (The GPU path, pinned D2H copies, runs in experiments/weights-colocated.)"""
import numpy as np
import pytest
import torch

from rollout_cluster.transfer.buckets import pack, pack_group, plan, unpack
from rollout_cluster.transfer.staging import ALIGN, Staging, bucket_span


def address(array) -> int:
    return array.__array_interface__["data"][0]


def strided_tensors():
    g = torch.Generator().manual_seed(3)
    return [(f"w{i}", torch.randn(24, 16 + i, generator=g).to(dtype).t())  # transposed views: not contiguous
            for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.float64])]


def put_each(buckets):
    """What ray.put does with each bucket before the next is packed: a copy of its bytes."""
    out, starts = [], []
    for b in buckets:
        starts.append(address(b["data"][0]))
        out.append({**b, "data": [np.array(d, copy=True) for d in b["data"]]})
    return out, starts


def test_copies_go_through_one_reused_buffer_and_come_back_exactly():
    named = strided_tensors()
    assert not any(t.is_contiguous() for _, t in named)
    stage = Staging()
    kept, starts = put_each(pack(named, bucket_bytes=2000, staging=stage))
    assert len(kept) >= 3 and len(set(starts)) == 1  # every bucket at the buffer's start: reused
    assert stage.nbytes <= 2000 + 64 * ALIGN  # a bucket and its alignment, not the model
    back = [pair for b in kept for pair in unpack(b)]
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, a), (_, b) in zip(named, back):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_a_bucket_kept_past_the_next_one_is_overwritten_so_push_puts_each_first():
    """The contract pack's docstring states: with staging a bucket's bytes are good until the next
    bucket is asked for. (Kept buckets all view the same memory: the last bucket's bytes.)"""
    named = [("a", torch.full((64, 8), 1.0).t()), ("b", torch.full((64, 8), 2.0).t())]
    first, second = list(pack(named, bucket_bytes=64 * 8 * 4, staging=Staging()))
    assert address(first["data"][0]) == address(second["data"][0])
    assert torch.equal(unpack(first)[0][1], torch.full((8, 64), 2.0))


def test_contiguous_cpu_tensors_are_viewed_not_copied():
    named = [("a", torch.arange(12.0).reshape(3, 4)), ("b", torch.ones(5, dtype=torch.int64))]
    stage = Staging()
    (bucket,) = pack(named, staging=stage)
    assert stage.nbytes == 0  # never allocated
    assert address(bucket["data"][0]) == named[0][1].data_ptr()


def test_the_buffer_grows_for_a_tensor_larger_than_a_bucket_and_mixed_buckets_keep_order():
    big = torch.arange(4000, dtype=torch.float32).reshape(40, 100).t()
    named = [("small", torch.arange(6.0)), ("big", big), ("view", torch.arange(20.0).reshape(4, 5).t())]
    stage = Staging()
    kept, _ = put_each(pack(named, bucket_bytes=1024, staging=stage))
    assert [b["names"] for b in kept] == [["small"], ["big"], ["view"]]
    assert stage.nbytes >= big.numel() * 4
    for (_, a), (_, b) in zip(named, [p for b in kept for p in unpack(b)]):
        assert torch.equal(a, b)


def test_a_streamed_push_packs_planned_groups_through_the_same_buffer():
    named = strided_tensors()
    stage = Staging()
    groups = plan(named, 2000)
    kept, starts = put_each(pack_group(g, stage, 2000) for g in groups)
    assert len(set(starts)) == 1
    assert [p[0] for b in kept for p in unpack(b)] == [n for n, _ in named]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(named, [p for b in kept for p in unpack(b)]))


def test_refused_pinned_memory_stages_in_pageable_memory(monkeypatch, caplog):
    """A GPU tensor's bucket asks for pinned memory; where it is refused (here: no CUDA at all,
    torch raises as it does for an exhausted pinned allocator) staging goes on in pageable memory."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    stage = Staging()
    stage.start(1000, cuda=True)
    assert stage.nbytes == 1000 and not stage.pin and "pinned memory refused" in caplog.text
    t = torch.arange(10.0).reshape(2, 5).t()
    assert torch.equal(torch.from_numpy(stage.take(t).copy()).view(torch.float32).reshape(5, 2), t)


def test_a_bucket_larger_than_started_is_refused_not_written_past_the_buffer():
    stage = Staging()
    stage.start(bucket_span([40]), cuda=False)
    with pytest.raises(RuntimeError, match="a bucket of .* bytes in a buffer of 64"):
        stage.take(torch.zeros(100))


def test_client_shutdown_frees_the_process_staging_buffer(monkeypatch):
    from types import SimpleNamespace

    from ray import serve

    from rollout_cluster.client import lifecycle
    from rollout_cluster.transfer import staging

    deleted = []
    monkeypatch.setattr(serve, "delete", deleted.append)
    shared = staging.shared()
    list(pack([("w", torch.ones(8, 4).t())], staging=shared))
    assert shared.nbytes > 0
    lifecycle.shutdown(SimpleNamespace(app_name="app-x", owns_cluster=False))
    assert deleted == ["app-x"] and shared.nbytes == 0
