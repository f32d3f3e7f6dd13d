"""Trainers' own clients against the real cluster (2 vLLM-CPU replicas): TRL's VLLMClient (its
generate with token ids and with strings, chat, reset_prefix_cache, get_world_size), the `openai`
package (completions with and without streaming, n > 1, logprobs, chat, a chat stream's role
chunks), TRL <= 1.10's routes as HTTP bodies, and multi-turn session affinity by X-Session-Id.
Every check counts tokens exactly (ignore_eos), aligns logprobs with tokens, and sees every sample
once and both replicas work."""
import json
import math
import re
import urllib.request

import openai
import pytest
from trl.generation.vllm_client import VLLMClient

from rollout_cluster.security.secrets import read_token

from e2e_support import METRICS_PORT, gateway_url, http_request, netrc_token

pytestmark = pytest.mark.e2e


def finished_by_replica() -> dict:
    """rollout_sequences_finished_total by replica (Prometheus, the router's)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10).read().decode()
    out = {}
    for m in re.finditer(r'^rollout_sequences_finished_total\{([^}]*)\} ([0-9.e+]+)$', text, re.M):
        replica = re.search(r'replica="([^"]+)"', m.group(1)).group(1)
        out[replica] = out.get(replica, 0.0) + float(m.group(2))
    return out


def worked(before: dict, after: dict) -> dict:
    return {rid: n - before.get(rid, 0.0) for rid, n in after.items() if rid != "-" and n > before.get(rid, 0.0)}


@pytest.fixture(scope="module")
def base_url(client):
    return gateway_url(client)


@pytest.fixture(scope="module")
def trl_client(client, base_url, tmp_path_factory):
    """TRL's client as docs/trainers.md says to use it: the token in a netrc file named by $NETRC,
    which `requests` (TRL's HTTP library) reads for every call, check_server's bare one included."""
    with netrc_token(client, base_url, tmp_path_factory.mktemp("netrc")):
        yield VLLMClient(base_url=base_url, connection_timeout=60)


def check_samples(result: dict, prompts: int, n: int, max_tokens: int) -> None:
    ids, lps, lp_ids = result["completion_ids"], result["logprobs"], result["logprob_token_ids"]
    assert len(result["prompt_ids"]) == prompts and len(ids) == prompts * n  # every sample once
    for seq, seq_lps, seq_lp_ids in zip(ids, lps, lp_ids):
        assert len(seq) == max_tokens and len(seq_lps) == max_tokens  # exact length, logprobs aligned
        assert [t for (t,) in seq_lp_ids] == seq  # the sampled token's logprob, per token
        assert all(math.isfinite(x) and x <= 0 for (x,) in seq_lps)


def test_trl_client_generates_from_token_ids_on_both_replicas(client, trl_client):
    before = finished_by_replica()
    prompts = [[5 + i, 6, 7, 8 + i] for i in range(8)]
    result = trl_client.generate(prompts, n=4, max_tokens=20, temperature=1.0, top_k=0, min_p=0.0,
                                 generation_kwargs={"ignore_eos": True})
    check_samples(result, 8, 4, 20)
    assert result["prompt_ids"] == prompts
    done = worked(before, finished_by_replica())
    assert len(done) == 2 and sum(done.values()) == 32  # one batch of 32, balanced over both replicas
    assert trl_client.get_world_size() == 1  # the weight relay's one rank, whatever the fleet's size
    # GRPOTrainer reads it for its importance-sampling correction
    assert trl_client.get_server_info()["model_config"]["logprobs_mode"] == client.config.engine.logprobs_mode


def test_trl_client_generates_from_strings_and_chats(trl_client):
    result = trl_client.generate(["The cluster", "Rollouts are"], n=2, max_tokens=9,
                                 generation_kwargs={"ignore_eos": True, "seed": 7})
    check_samples(result, 2, 2, 9)
    assert all(len(p) > 0 for p in result["prompt_ids"])
    convs = [[{"role": "user", "content": "Add 2 and 3."}], [{"role": "system", "content": "Be brief."},
                                                           {"role": "user", "content": "Hello"}]]
    chat = trl_client.chat(convs, n=3, max_tokens=7, generation_kwargs={"ignore_eos": True})
    check_samples(chat, 2, 3, 7)
    trl_client.reset_prefix_cache()


def test_trl_without_the_token_is_refused_but_health_is_open(base_url):
    assert urllib.request.urlopen(base_url + "/health", timeout=10).status == 200
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(base_url + "/get_world_size", timeout=10)
    assert e.value.code == 401


def test_openai_completions_with_n_logprobs_and_token_ids(client, base_url):
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key=read_token(client.config.security), max_retries=0)
    (model,) = oai.models.list().data
    out = oai.completions.create(model=model.id, prompt=[[11, 12, 13], [14, 15]], n=3, max_tokens=15, logprobs=0,
                                 temperature=1.0, extra_body={"ignore_eos": True, "return_token_ids": True})
    assert [c.index for c in out.choices] == list(range(6))
    for c in out.choices:
        ids = c.model_extra["token_ids"]
        assert len(ids) == 15 and len(c.logprobs.token_logprobs) == 15 and c.finish_reason == "length"
        assert all(x <= 0 for x in c.logprobs.token_logprobs)
    assert out.usage.completion_tokens == 90 and out.usage.prompt_tokens == 3 + 2  # once per prompt, as vLLM counts
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model.id, prompt=[1, 2], max_tokens=5, temperature=-2)
    assert e.value.body["param"] == "temperature"


def test_openai_stream_sends_every_choice_once_and_chat_answers(client, base_url):
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key=read_token(client.config.security), max_retries=0)
    model = oai.models.list().data[0].id
    seen = {}
    for chunk in oai.completions.create(model=model, prompt="Once upon", n=4, max_tokens=11, stream=True,
                                        extra_body={"ignore_eos": True, "return_token_ids": True}):
        for c in chunk.choices:
            assert c.index not in seen
            seen[c.index] = c.model_extra["token_ids"]
    assert sorted(seen) == [0, 1, 2, 3] and all(len(ids) == 11 for ids in seen.values())
    chat = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], n=2,
                                       max_tokens=6, logprobs=True, top_logprobs=0,
                                       extra_body={"ignore_eos": True, "return_token_ids": True})
    assert len(chat.choices) == 2
    for c in chat.choices:
        assert len(c.model_extra["token_ids"]) == 6 and len(c.logprobs.content) == 6
        assert isinstance(c.message.content, str)


def test_openai_chat_stream_opens_each_choice_with_its_role(client, base_url):
    """vLLM's chat stream: each choice's first chunk is its role with empty content, before any
    text; a client that builds each message from the chunks gets role and text for every choice."""
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key=read_token(client.config.security), max_retries=0)
    model = oai.models.list().data[0].id
    chunks = list(oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=5, logprobs=True, top_logprobs=0,
        stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True, "return_token_ids": True}))
    built, prompt = {}, None
    for chunk in chunks[:-1]:
        (c,) = chunk.choices
        m = built.setdefault(c.index, {"role": None, "content": "", "token_ids": []})
        if c.delta.role is not None:  # the role chunk: no text, no logprobs, the prompt's ids, 0 tokens so far
            assert m["role"] is None and c.delta.content == "" and c.logprobs is None and c.finish_reason is None
            assert chunk.usage.completion_tokens == 0
            prompt = chunk.model_extra["prompt_token_ids"]
            m["role"] = c.delta.role
            continue
        assert m["role"] == "assistant"  # content comes after its choice's role
        m["content"] += c.delta.content
        m["token_ids"] += c.model_extra["token_ids"]
        assert len(c.logprobs.content) == 5 and chunk.usage.completion_tokens == 5
    assert sorted(built) == [0, 1] and all(m["role"] == "assistant" and len(m["token_ids"]) == 5
                                           for m in built.values())
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert len(prompt) > 0 and chunks[-1].usage.prompt_tokens == len(prompt)


def test_openai_truncate_prompt_tokens_cuts_the_prompt_the_engines_run(client, base_url):
    """vLLM's truncate_prompt_tokens keeps a prompt's last k tokens, text or ids, as vLLM's server does."""
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key=read_token(client.config.security), max_retries=0)
    model = oai.models.list().data[0].id
    extra = {"ignore_eos": True, "return_token_ids": True}
    out = oai.completions.create(model=model, prompt=[[11, 12, 13], [14, 15]], max_tokens=4,
                                 extra_body={**extra, "truncate_prompt_tokens": 2})
    assert [c.model_extra["prompt_token_ids"] for c in out.choices] == [[12, 13], [14, 15]]
    assert out.usage.prompt_tokens == 4 and all(len(c.model_extra["token_ids"]) == 4 for c in out.choices)
    whole = oai.completions.create(model=model, prompt="Once upon a time", max_tokens=2, extra_body=extra)
    cut = oai.completions.create(model=model, prompt="Once upon a time", max_tokens=2,
                                 extra_body={**extra, "truncate_prompt_tokens": 2, "truncation_side": "left"})
    assert cut.choices[0].model_extra["prompt_token_ids"] == whole.choices[0].model_extra["prompt_token_ids"][-2:]


def test_trl_legacy_routes_as_http_bodies(client):
    cfg = client.config
    body = json.dumps({"prompts": [[21, 22, 23]], "n": 2, "max_tokens": 8,
                       "generation_kwargs": {"ignore_eos": True}}).encode()
    req = http_request(cfg, "/generate/", body, "POST")
    req.add_header("Content-Type", "application/json")
    answer = json.loads(urllib.request.urlopen(req, timeout=300).read())
    assert answer["prompt_ids"] == [[21, 22, 23]] and [len(c) for c in answer["completion_ids"]] == [8, 8]
    assert [len(lp) for lp in answer["logprobs"]] == [8, 8]
    bad = http_request(cfg, "/generate/", json.dumps({"prompts": [[1]], "top_p": 0}).encode(), "POST")
    bad.add_header("Content-Type", "application/json")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(bad, timeout=60)
    assert e.value.code == 422 and "top_p" in e.value.read().decode()
    assert json.loads(urllib.request.urlopen(http_request(cfg, "/get_world_size/"), timeout=60).read()) == {
        "world_size": 1}


def test_session_turns_go_home_by_header(client, base_url):
    """Two turns of 6 sessions through /v1/completions, each a request with its X-Session-Id: every
    second turn is queued with a home (the replica of its first turn)."""
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key=read_token(client.config.security), max_retries=0)
    model = oai.models.list().data[0].id
    before = client.status()["sessions"]
    prompts = {f"e2e-agent-{i}": [31 + i, 32, 33, 34] for i in range(6)}
    for turn in range(2):
        for sid, prompt in prompts.items():
            out = oai.completions.create(model=model, prompt=prompt, max_tokens=8,
                                         extra_body={"ignore_eos": True, "return_token_ids": True},
                                         extra_headers={"X-Session-Id": sid})
            prompts[sid] = prompt + out.choices[0].model_extra["token_ids"] + [40 + turn]
    after = client.status()["sessions"]
    assert after["homed_turns"] - before["homed_turns"] == 6  # every second turn had its home
    assert after["unhomed_turns"] - before["unhomed_turns"] == 6  # first turns: new sessions


def test_session_turns_run_where_the_previous_turn_ran(client):
    from rollout_cluster.protocol import SamplingSpec

    sessions = [f"e2e-driver-{i}" for i in range(8)]
    prompts = [[41 + i, 42, 43] for i in range(8)]
    spec = SamplingSpec(max_tokens=6, ignore_eos=True)
    first = client.generate(prompts, spec, sessions=sessions, timeout_s=300)
    assert len({c.replicas[0] for c in first}) == 2  # the first turns spread over both replicas
    second = client.generate([p + list(c.token_ids) + [50] for p, c in zip(prompts, first)], spec,
                             sessions=sessions, timeout_s=300)
    assert [c.replicas[0] for c in second] == [c.replicas[0] for c in first]
