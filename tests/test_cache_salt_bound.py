"""Regression: `cache_salt` had no length bound, and every sequence of a request carries it to
the engine (and through each migration): a body of one 64 MiB salt and n samples held n
references to it in the router and sent it to the engines with every start. It is bounded as a
session id is (validation.MAX_SESSION_CHARS), refused naming the field with its value cut short,
on every road in: the library's SamplingSpec, the JSONL /generate, the OpenAI and TRL routes."""
import json

import pytest

from rollout_cluster.protocol import InputError, SamplingSpec
from test_protocols import AUTH, codec, http, router  # noqa: F401 (fixtures)

LONG = "s" * 100_000


def test_cache_salt_of_unbounded_length_is_refused_naming_it():
    from rollout_cluster.protocol.requests import MAX_CACHE_SALT_CHARS

    assert MAX_CACHE_SALT_CHARS == 256
    SamplingSpec(cache_salt="s" * MAX_CACHE_SALT_CHARS).validate()
    with pytest.raises(InputError) as e:
        SamplingSpec(cache_salt="s" * (MAX_CACHE_SALT_CHARS + 1)).validate()
    assert e.value.field == "cache_salt" and str(e.value).startswith("cache_salt='sss")
    assert "256 characters" in str(e.value)
    with pytest.raises(InputError) as e:
        SamplingSpec(cache_salt=LONG).validate()
    assert len(str(e.value)) < 300  # the value is shown cut short


def test_cache_salt_too_long_on_the_jsonl_generate_route(http):
    line = json.dumps({"prompt_token_ids": [5, 6], "max_tokens": 2, "cache_salt": LONG}) + "\n"
    answer = http.post("/generate", content=line.encode(), headers=AUTH)
    records = [json.loads(x) for x in answer.text.splitlines()]
    assert len(records) == 1 and records[0]["error"].startswith("cache_salt=") and len(records[0]["error"]) < 300


def test_cache_salt_too_long_on_the_openai_routes(http):
    for route, body in (("/v1/completions", {"prompt": [5, 6], "max_tokens": 2}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})):
        answer = http.post(route, headers=AUTH, json={**body, "cache_salt": LONG})
        assert answer.status_code == 400, answer.text
        err = answer.json()["error"]
        assert err["param"] == "cache_salt" and "256 characters" in err["message"] and len(err["message"]) < 300


def test_cache_salt_too_long_on_the_trl_route(http):
    answer = http.post("/generate/", headers=AUTH,
                       json={"prompts": [[5, 6]], "max_tokens": 2, "generation_kwargs": {"cache_salt": LONG}})
    assert answer.status_code == 422, answer.text
    detail = answer.json()["detail"][0]
    assert detail["loc"] == ["body", "cache_salt"] and len(detail["msg"]) < 300
