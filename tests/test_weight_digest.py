"""weight_digest.py: an exact digest of a tensor's bits, computed with torch where the tensor lives.
Same bits give the same digest, whatever the chunk size; one flipped bit, a permutation, another
dtype or shape give another; the result equals a plain-Python reference of the definition."""
import pytest
import torch

from rollout_cluster.engines.weight_digest import (GOLDEN, MASK64, MIX1, MIX2, bits_digest, combined, merge_workers,
                                                   model_digest, tensor_digest)


def reference(t) -> int:
    """The definition, in Python integers: sum of mix64(word_i + (i + 1) * GOLDEN) mod 2^64."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).tolist() if t.numel() else []
    data += [0] * (-len(data) % 4)
    total = 0
    for i in range(len(data) // 4):
        z = (int.from_bytes(bytes(data[4 * i:4 * i + 4]), "little") + (i + 1) * GOLDEN) & MASK64
        z = ((z ^ (z >> 30)) * MIX1) & MASK64
        z = ((z ^ (z >> 27)) * MIX2) & MASK64
        total = (total + (z ^ (z >> 31))) & MASK64
    return total


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8,
                                   torch.uint8, torch.int64, torch.bool])
@pytest.mark.parametrize("n", [0, 1, 3, 7, 1000])
def test_the_digest_is_its_definition_for_every_dtype_and_odd_lengths(dtype, n):
    g = torch.Generator().manual_seed(n)
    t = (torch.randn(n, generator=g) * 100).to(dtype)
    assert bits_digest(t) == reference(t)
    assert bits_digest(t, chunk=1) == bits_digest(t, chunk=3) == bits_digest(t)


def test_chunk_boundaries_do_not_matter():
    t = torch.randn(1001, 37, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0))
    digests = {bits_digest(t, chunk=c) for c in (1, 2, 5, 64, 1000, 18518, 18519, 1 << 20)}
    assert len(digests) == 1


def test_one_flipped_bit_anywhere_changes_it():
    t = torch.randn(257, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
    base = tensor_digest(t)
    raw = t.view(torch.int16)
    for i in (0, 1, 128, 256):
        for bit in (0, 7, 15):
            flipped = raw.clone()
            flipped[i] ^= torch.tensor(1 << bit, dtype=torch.int16) if bit < 15 else torch.tensor(-32768, dtype=torch.int16)
            assert tensor_digest(flipped.view(torch.bfloat16)) != base, (i, bit)


def test_permuted_elements_and_another_shape_change_it():
    t = torch.randn(64, generator=torch.Generator().manual_seed(2))
    assert tensor_digest(t.flip(0)) != tensor_digest(t)
    swapped = t.clone()
    swapped[[3, 40]] = swapped[[40, 3]]
    assert bits_digest(swapped) != bits_digest(t)
    assert tensor_digest(t.view(8, 8)) != tensor_digest(t)  # same bytes, another shape
    assert tensor_digest(t.view(8, 8).t()) != tensor_digest(t.view(8, 8))  # row-major order of a transposed view


def test_same_bits_in_another_dtype_share_bits_but_not_the_tensor_digest():
    t = torch.randn(10, dtype=torch.bfloat16)
    as_int = t.view(torch.int16)
    assert bits_digest(as_int) == bits_digest(t)
    assert tensor_digest(as_int) != tensor_digest(t)
    assert tensor_digest(t.clone()) == tensor_digest(t)


def test_unaligned_views_and_non_contiguous_tensors():
    base = torch.arange(100, dtype=torch.int16)
    view = base[1:]  # starts 2 bytes into the storage: cannot be read as int32 in place
    assert bits_digest(view, chunk=3) == bits_digest(view.clone()) == reference(view)
    m = torch.randn(6, 5)
    assert bits_digest(m.t()) == bits_digest(m.t().contiguous())


def test_bad_chunk_is_refused_by_name():
    with pytest.raises(ValueError, match="chunk=0"):
        bits_digest(torch.zeros(3), chunk=0)
    with pytest.raises(ValueError, match="chunk="):
        bits_digest(torch.zeros(3), chunk=1 << 27)


def test_a_large_tensor_is_taken_in_bounded_chunks(monkeypatch):
    """10 M bf16 values in chunks of 1 M words: every step sees at most one chunk."""
    import rollout_cluster.engines.weight_digest as wd

    seen = []
    real = wd._mixed_sum
    monkeypatch.setattr(wd, "_mixed_sum", lambda words, start: seen.append(words.numel()) or real(words, start))
    t = torch.ones(10_000_001, dtype=torch.bfloat16)
    d = bits_digest(t, chunk=1 << 20)
    assert max(seen) == 1 << 20 and sum(seen) == 5_000_001
    monkeypatch.setattr(wd, "_mixed_sum", real)
    assert bits_digest(t, chunk=1 << 22) == d


def test_model_digest_and_the_combined_digest():
    a = {"w": torch.randn(4, 4), "b": torch.zeros(4)}
    d = model_digest(a.items())
    assert d["params"]["w"] == {"digest": tensor_digest(a["w"]), "dtype": "float32", "shape": [4, 4]}
    assert d["digest"] == model_digest(reversed(list(a.items())))["digest"]  # names sorted
    assert d["digest"] != model_digest({"w": a["w"], "b": torch.ones(4)}.items())["digest"]
    assert d["digest"] != model_digest({"w2": a["w"], "b": a["b"]}.items())["digest"]  # the names count
    assert combined({}) == combined({})
    one = merge_workers([d], detail=False)
    assert one == {"digest": d["digest"]}
    two = merge_workers([d, d], detail=True)
    assert two["digest"] != d["digest"] and set(two["params"]) == {"rank0/w", "rank0/b", "rank1/w", "rank1/b"}


# GPU == CPU is checked on a GPU machine by experiments/weights-colocated/digest_gpu_check.py
# (90 cases and the 7B timing): CI has no GPU.
