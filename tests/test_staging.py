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


class FakeCudart:
    """torch.cuda.cudart() with page-locking that answers `code` (0: success), calls logged."""

    def __init__(self, code: int):
        self.code, self.calls = code, []

    def cudaHostRegister(self, ptr, size, flags):
        self.calls.append(("register", ptr, size))
        return self.code

    def cudaHostUnregister(self, ptr):
        self.calls.append(("unregister", ptr))
        return 0


def fake_cuda(monkeypatch, code: int) -> FakeCudart:
    cudart = FakeCudart(code)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)

    def check_error(res):
        if res != 0:
            raise RuntimeError(f"CUDA error {res}")

    monkeypatch.setattr(torch.cuda, "check_error", check_error)
    return cudart


def test_a_gpu_bucket_page_locks_exactly_the_buffer_and_release_unlocks_and_frees_it(monkeypatch):
    cudart = fake_cuda(monkeypatch, 0)
    stage = Staging()
    stage.start(1000, cuda=True, reserve=1 << 20)
    size = (1 << 20) + (1 << 20) // 64  # the bucket and room for its alignment
    ptr = stage._buf.data_ptr()
    assert stage.nbytes == size and cudart.calls == [("register", ptr, size)]  # not rounded up
    stage.start(2000, cuda=True, reserve=1 << 20)  # fits: neither allocated nor locked again
    assert len(cudart.calls) == 1
    assert stage.release() and stage.nbytes == 0 and cudart.calls[-1] == ("unregister", ptr)


def test_refused_page_locking_stages_in_pageable_memory_until_release(monkeypatch, caplog):
    """Where page-locking is refused (a container's locked-memory limit) staging goes on in
    pageable memory, without asking again for every bucket; release() lets it try again."""
    cudart = fake_cuda(monkeypatch, 2)
    stage = Staging()
    stage.start(1000, cuda=True)
    assert stage.nbytes == 1000 and not stage._pinned and "page-locking 1000 bytes refused" in caplog.text
    t = torch.arange(10.0).reshape(2, 5).t()
    assert torch.equal(torch.from_numpy(stage.take(t).copy()).view(torch.float32).reshape(5, 2), t)
    stage.start(1000, cuda=True)
    assert len(cudart.calls) == 1  # not asked again
    assert stage.release() and not any(c[0] == "unregister" for c in cudart.calls)
    stage.start(1000, cuda=True)  # tried again after release
    assert len(cudart.calls) == 2


def test_release_waits_for_no_bucket_being_packed():
    """shutdown() may run while another thread packs a bucket, or from a signal handler on the
    thread that packs: release() then leaves the buffer alone instead of blocking."""
    stage = Staging()
    list(pack([("w", torch.ones(8, 4).t())], staging=stage))
    with stage.lock:
        assert stage.release() is False and stage.nbytes > 0
    assert stage.release() is True and stage.nbytes == 0


@pytest.mark.parametrize("stream", ["0", "1"])
@pytest.mark.parametrize("staged", ["1", "0"])
def test_push_puts_each_staged_bucket_before_it_packs_the_next(monkeypatch, stream, staged):
    """push() (default and streamed, staged or not: ROLLOUT_PUSH_STAGING): every bucket is in the
    store (here: copied, as ray.put copies) before the next is packed into the same buffer."""
    import ray

    from router_support import SIGNER
    from rollout_cluster.transfer import push as push_mod
    from rollout_cluster.transfer import staging
    from test_push_stream import FakeRef, FakeRouter

    puts = []

    def put(obj):
        if isinstance(obj, dict) and "data" in obj:
            obj = {**obj, "data": [np.array(d, copy=True) for d in obj["data"]]}
        puts.append(obj)
        return FakeRef(len(puts) - 1)

    monkeypatch.setattr(ray, "put", put)
    monkeypatch.setenv(push_mod.STREAM_ENV, stream)
    monkeypatch.setenv(push_mod.STAGING_ENV, staged)
    shared = staging.shared()
    shared.release()
    named = strided_tensors()
    push_mod.push(FakeRouter([]), SIGNER, named, None, 2000, 5.0)
    back = [pair for b in puts if "data" in b for pair in unpack(b)]
    assert len([b for b in puts if "data" in b]) >= 3 and [n for n, _ in back] == [n for n, _ in named]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(named, back))
    assert (shared.nbytes > 0) == (staged == "1")
    shared.release()


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
