"""A pushed bucket, or a push's manifest, whose header lists (names, dtypes, shapes, data) differ
in length is refused naming them (buckets.check_lists). Read with zip(), which stops at the
shortest, the tensors past it vanished without a word, and a load went on a tensor short, found
missing only once the engine had begun replacing its weights."""
import pytest
import torch

from rollout_cluster.engines.weight_checks import check_ahead
from rollout_cluster.transfer.buckets import Manifest, pack, unpack


def _bucket():
    (bucket,) = pack([("a.weight", torch.ones(2)), ("b.weight", torch.full((3,), 2.0))], 1 << 20)
    return bucket


@pytest.mark.parametrize("short", ["data", "dtypes", "shapes"])
def test_a_bucket_whose_header_lists_differ_in_length_is_refused_not_unpacked_a_tensor_short(short):
    bucket = _bucket()
    bucket[short] = bucket[short][:1]  # names announce a.weight and b.weight; one list holds only a.weight's entry
    with pytest.raises(ValueError):
        got = unpack(bucket)
        pytest.fail(f"unpacked {[n for n, _ in got]} from a bucket whose names are {bucket['names']}")


def test_a_manifest_whose_header_lists_differ_in_length_is_refused_before_any_bucket_loads():
    """check_ahead (no spec: a model without checkpoint files or config) passed a manifest
    announcing a.weight and b.weight with one dtype and one shape as announcing a.weight alone."""
    manifest = Manifest([{"names": ["a.weight", "b.weight"], "dtypes": ["float32"], "shapes": [[2]]}])
    with pytest.raises(ValueError):
        check_ahead(manifest, None)
        pytest.fail(f"accepted as {[[n for n, _ in b] for b in manifest.meta_buckets()]}")
