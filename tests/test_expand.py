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
