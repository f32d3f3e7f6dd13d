"""The driver's edges a review found: a JSONL "abort" line cut before its first token resumes as
an input line; a second router death is timed from the second router's answer; a finish
fraction cuts at that share, not one more; sessions and sampling that are no lists are refused by
name. No Ray, no engines: the sans-I/O follower, the JSONL reader and a RouterCore here."""
import json

from ray.exceptions import ActorDiedError

from rollout_cluster.client.expand import expand
from rollout_cluster.client.follower import BatchCut, BatchFollower, Fail, Fetch, Pause, Submit
from rollout_cluster.client.jsonl import merge_results, read_requests
from rollout_cluster.protocol import BatchLostError, Completion, SamplingSpec, SequenceRequest

from test_router_adoption import finish, new_router

OUTPUT_ONLY = ("prompt_index", "sample_index", "token_ids", "logprobs", "finish_reason", "error", "replicas",
               "migrations", "finish_time_s", "weights_version", "resumed_tokens", "weight_versions")


def as_input_line(prompt, sampling: dict, out: dict) -> str:
    """jsonl.py's rule: an output line with finish_reason "abort" resumes as an input line with its
    token_ids and logprobs as the output_ fields."""
    assert out["finish_reason"] == "abort"
    return json.dumps({"prompt_token_ids": prompt, **sampling,
                       "output_token_ids": out["token_ids"], "output_logprobs": out["logprobs"]})


def test_a_jsonl_abort_line_cut_before_its_first_token_resumes_as_documented():
    """docs/semantics.md: a cut batch's queued sequences 'come back with none' (tokens), and 'an
    output line with finish_reason "abort" resumes as such an input line'. jsonl.py says the same.
    The Partial path (expand) starts such a sample afresh; the JSONL reader refuses the line with
    'output_token_ids=[]: must be null or a non-empty list', so `--finish-fraction` output cannot be
    fed back as the next step's input whenever anything was still queued at the cut."""
    sampling = {"max_tokens": 6, "logprobs": 0}
    core = new_router()
    first_lines = [json.dumps({"prompt_token_ids": [5, 6], **sampling})]
    reqs, errors = read_requests(first_lines)
    bid = core.submit(reqs, 1.0)
    core.cancel(bid, 1.1)  # cut (finish_fraction) while the sequence was still queued
    results, _, done = core.fetch(bid, 0)
    assert done
    (out,) = merge_results(len(first_lines), reqs, sorted(results, key=lambda c: c.index), errors)
    assert out["finish_reason"] == "abort" and out["token_ids"] == []

    again, errors = read_requests([as_input_line([5, 6], sampling, out)])
    assert errors == {}, errors
    assert len(again) == 1 and again[0].output_token_ids is None and again[0].output_logprobs is None
    bid = core.submit(again, 2.0)
    finish(core, 2.0, extra=6)
    (c,), _, _ = core.fetch(bid, 0)
    assert c.finish_reason == "length" and len(c.token_ids) == 6 and c.resumed_tokens == 0


def requests(n: int) -> list:
    return [SequenceRequest([5, 6], SamplingSpec(max_tokens=4), i, 0) for i in range(n)]


def test_a_second_router_death_gets_its_own_call_timeout_s():
    """docs/semantics.md: 'A driver waits for the new router up to call_timeout_s and resubmits at
    most max_router_restarts (3) times a batch'. The follower notes when fetches started failing
    (gone_since) and clears it only on a fetch that answers: a new router's BatchLostError and a
    resubmission that it answered leave it set. If that new router dies too before a fetch of the
    resubmitted batch answers, the batch fails at once with 'the router has not answered for 6 s
    since it died', though that router answered 2 s earlier and died under this very fetch."""
    follow = BatchFollower(requests(4), timeout_s=600.0, call_timeout_s=5.0)
    assert isinstance(follow.next(100.0), Submit)
    follow.submitted({"batch_id": "r1-b0", "weights_version": 0}, 100.0)
    assert follow.next(100.0) == Fetch("r1-b0", 0)
    follow.fetch_failed(ActorDiedError(), 100.0, router_gone=True)  # the first router died
    assert follow.next(100.0) == Pause(0.5)
    follow.fetch_failed(BatchLostError("made by another router"), 104.0)  # Serve's new one answers
    again = follow.next(104.0)
    assert isinstance(again, Submit) and again.restart
    follow.submitted({"batch_id": "r2-b0", "weights_version": 0}, 104.5)  # and takes the resubmission
    assert follow.next(105.0) == Fetch("r2-b0", 0)
    follow.fetch_failed(ActorDiedError(), 106.0, router_gone=True)  # the second router dies: wait for it
    action = follow.next(106.0)
    assert not isinstance(action, Fail), action.error
    assert action == Pause(0.5)


def test_finish_fraction_cuts_at_that_share_not_one_more():
    """docs/semantics.md: 'finish_fraction=0.9 cancels the batch once 90 % of its sequences are
    back'. BatchCut takes ceil(fraction * units) in floating point: 0.55 * 100 is
    55.00000000000001, so a batch of 100 waits for 56 samples (0.07 of 100: 8 instead of 7; 0.14
    of 50: 8 instead of 7) and the samples past the intended cut keep running."""
    for fraction, units, at in [(0.55, 100, 55), (0.07, 100, 7), (0.14, 50, 7), (0.28, 100, 28)]:
        assert BatchCut(requests(units), fraction).at == at, (fraction, units)
    follow = BatchFollower(expand([[5, 6]] * 100, SamplingSpec(max_tokens=4)), finish_fraction=0.55)
    follow.submitted({"batch_id": "r1-b0", "weights_version": 0})
    follow.take([Completion(i, 0, [1], None, "length", index=i) for i in range(55)], 55)
    assert follow.should_cut()  # 55 of 100 back: 55 %


def test_sessions_that_are_no_list_are_refused_naming_the_field():
    """README/docs: bad input gets an error naming the field and the value. expand checks
    `sessions` (one id per prompt, not a str) and, in the same function, refuses a hidden_lengths
    that is no sequence by name; a `sessions` without len() (an int, a generator of ids) crashes
    instead with "TypeError: object of type 'int' has no len()", naming nothing, from generate and
    stream alike."""
    import pytest

    from rollout_cluster.protocol import InputError

    for bad in (7, (s for s in ["agent-1"])):
        with pytest.raises(InputError, match=r"^sessions="):
            expand([[1, 2]], SamplingSpec(max_tokens=4), sessions=bad)


def test_a_resumed_jsonl_line_is_seeded_as_the_sample_it_was():
    """A seeded group's cut samples resumed from JSONL were all seeded seed + 0 (a line is one
    sample, its index 0): the line takes the output's sample_index, as a Partial does."""
    base = {"prompt_token_ids": [1, 2, 3], "max_tokens": 8, "seed": 100}
    lines = [json.dumps({**base, "output_token_ids": [4, 5], "sample_index": j}) for j in (0, 3, 7)]
    reqs, errors = read_requests(lines)[:2]
    assert not errors and [r.sampling.seed for r in reqs] == [100, 103, 107]
    bad = [json.dumps({**base, "sample_index": -1}), json.dumps({**base, "n": 2, "sample_index": 1}),
           json.dumps({**base, "sample_index": True})]
    _, errors = read_requests(bad)[:2]
    assert len(errors) == 3 and all(e.startswith("sample_index=") for e in errors.values()), errors
