"""Request expansion (client/expand.py): one request per (prompt, sample), in input order, so that
a trainer gets n results for every prompt, bad ones included (each an error naming the field)."""
import pytest

from rollout_cluster.client.expand import expand
from rollout_cluster.protocol import InputError, Partial, SamplingSpec
from rollout_cluster.validation import check_request


def test_every_prompt_gives_n_requests_even_one_that_cannot_run():
    spec = SamplingSpec(n=3, max_tokens=8)
    reqs = expand([[1, 2], "not tokens", [3]], spec)
    assert [(r.prompt_index, r.sample_index) for r in reqs] == [(i, j) for i in range(3) for j in range(3)]
    with pytest.raises(InputError, match="prompt_token_ids"):
        check_request(reqs[3])  # the router refuses each of the bad prompt's samples, naming the field


def test_an_invalid_n_gives_one_request_and_a_partial_one():
    reqs = expand([[1, 2], Partial([1, 2], [5])], [SamplingSpec(n=0), SamplingSpec(n=4, max_tokens=8)])
    assert [(r.prompt_index, r.sample_index) for r in reqs] == [(0, 0), (1, 0)]
    assert reqs[1].output_token_ids == [5]
    with pytest.raises(InputError, match="^n=0"):
        check_request(reqs[0])


def test_the_samples_of_a_seeded_prompt_get_distinct_seeds_as_vllms_n_does():
    """Regression: expand and the JSONL reader gave every one of a prompt's n samples the spec's
    seed, so with a seed the n samples were one sample n times (the same prompt, the same seed:
    vLLM draws the same tokens), and a GRPO group had no spread. vLLM's own n > 1 seeds child j
    with seed + j (vllm/v1/engine/parallel_sampling.py); so do these now. No seed stays no seed."""
    import json

    from rollout_cluster.client.jsonl import read_requests

    reqs = expand([[1, 2], [3]], [SamplingSpec(n=4, max_tokens=8, seed=7), SamplingSpec(n=2, max_tokens=8)])
    assert [(r.prompt_index, r.sample_index, r.sampling.seed) for r in reqs] == [
        (0, 0, 7), (0, 1, 8), (0, 2, 9), (0, 3, 10), (1, 0, None), (1, 1, None)]
    assert {r.sampling.n for r in reqs} == {4, 2}  # the rest of the spec as given
    lines = [json.dumps({"prompt_token_ids": [1, 2], "n": 3, "seed": 2**63 - 2}),
             json.dumps({"prompt_token_ids": [1, 2], "n": 2})]
    got, errors = read_requests(lines)
    assert not errors
    # within 64 bits, as every seed must be: the last one wraps around
    assert [r.sampling.seed for r in got] == [2**63 - 2, 2**63 - 1, -2**63, None, None]
    for r in reqs + got:
        check_request(r)


def test_a_partial_keeps_its_prompts_session():
    """Regression: expand gave `sessions` to fresh prompts only; a resumed Partial among the prompts
    lost its session id, so its continuation went anywhere instead of to the replica that holds
    its session's prefix."""
    reqs = expand([[1, 2], Partial([3, 4], [5, 6])], SamplingSpec(n=2, max_tokens=8), sessions=["a", "b"])
    assert [(r.prompt_index, r.session) for r in reqs] == [(0, "a"), (0, "a"), (1, "b")]


def test_samples_cut_before_their_first_token_start_again_as_distinct_samples():
    """Regression: a seeded batch cut at finish_fraction hands its queued samples back with no
    token; partials() made them Partials of the prompt alone, and the next batch started each as
    sample 0, seed + 0: the group's cut samples were one sample several times, the same as its
    sample 0 of the batch before. A Partial keeps its sample's place, and is seeded as that sample;
    one cut again keeps it too."""
    from rollout_cluster.protocol import Completion, partials

    spec = SamplingSpec(n=4, max_tokens=8, seed=7)
    cut = [Completion(0, j, [] if j >= 2 else [3], None, "abort" if j else "length") for j in range(4)]
    carry = partials([[1, 2]], cut)
    assert [p.sample_index for p in carry] == [1, 2, 3]
    reqs = expand(carry, spec)
    assert [r.sampling.seed for r in reqs] == [8, 9, 10] and [r.sample_index for r in reqs] == [0, 0, 0]
    again = partials(carry, [Completion(i, 0, [], None, "abort") for i in range(3)])  # cut again before a token
    assert [p.sample_index for p in again] == [1, 2, 3]
    assert [r.sampling.seed for r in expand(again, spec)] == [8, 9, 10]
    assert expand([Partial([1, 2], [])], spec)[0].sampling.seed == 7  # a Partial made by hand: sample 0
