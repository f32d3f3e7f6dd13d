"""The Gateway's front door (serve/gateway.py, serve/protocols/) bounds the work a request makes: each
test names what it bounds, and failed before the bound was there."""
import json

import pytest

from test_protocols import AUTH, TextRouter, app_over, codec  # noqa: F401 (fixtures)


def post(http, path, body, headers=None):
    return http.post(path, content=body if isinstance(body, (str, bytes)) else json.dumps(body),
                     headers={**AUTH, "content-type": "application/json", **(headers or {})})


@pytest.fixture
def router(codec):  # noqa: F811
    return TextRouter(codec)


# ---- the prompt count (prompts x n <= limits.max_batch_sequences) is checked only after every prompt
# was tokenized / rendered: a 64 MiB body of ["a", "a", ...] (16M prompts) holds the event loop for
# minutes (200,000 prompts: 1.5 s; 20,000 TRL conversations: 2.4 s) before the 400 ----------------------
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": ["a b"] * 50, "max_tokens": 2}),
    ("/generate/", {"prompts": ["a b"] * 50, "max_tokens": 2}),
    ("/chat/", {"messages": [[{"role": "user", "content": "a b"}]] * 50, "max_tokens": 2}),
])
def test_too_many_prompts_are_refused_before_any_is_tokenized(router, codec, monkeypatch, path, body):  # noqa: F811
    calls = []
    real_encode, real_render = codec.encode, codec.render_chat
    monkeypatch.setattr(codec, "encode", lambda *a, **kw: (calls.append("encode"), real_encode(*a, **kw))[1])
    monkeypatch.setattr(codec, "render_chat", lambda *a, **kw: (calls.append("render"), real_render(*a, **kw))[1])
    http = app_over(router, codec, max_batch_sequences=4, max_live_sequences=4)
    got = post(http, path, body)
    assert got.status_code in (400, 422) and "max_batch_sequences=4" in got.text, got.text
    assert not hasattr(router, "submitted")
    # 50 prompts, a limit of 4: counting them needs no tokenizer (it ran 50 times, 100 for /chat/)
    assert len(calls) <= 4, f"{len(calls)} tokenizer/template calls before the count was refused"


@pytest.mark.parametrize("path, body, field", [
    ("/generate/", {"prompts": [[1, 2]] * 5, "max_tokens": 2}, "prompts"),
    ("/chat/", {"messages": [[{"role": "user", "content": "a"}]] * 5, "max_tokens": 2}, "messages"),
])
def test_trl_count_refusal_names_the_trl_field(router, codec, path, body, field):  # noqa: F811
    """TRL's 422 names `loc: ["body", "prompt"]`, a field neither TRL route has."""
    got = post(app_over(router, codec, max_batch_sequences=4, max_live_sequences=4), path, body)
    assert got.status_code == 422, got.text
    assert got.json()["detail"][0]["loc"] == ["body", field], got.text


# ---- a cache_salt with a lone UTF-16 surrogate passes the JSONL route (and SamplingSpec.validate) and
# reaches the engines, whose vLLM sends it to EngineCore with msgspec, which cannot encode it (the
# OpenAI/TRL routes refuse it by name; the JSONL route and RolloutClient do not) ------------------------
def test_jsonl_cache_salt_with_a_lone_surrogate_is_refused_by_name(router, codec):  # noqa: F811
    import msgspec

    with pytest.raises(UnicodeEncodeError):  # what vLLM's EngineCoreRequest encoder does with it
        msgspec.msgpack.encode({"cache_salt": "\ud800"})
    http = app_over(router, codec)
    line = '{"prompt_token_ids": [5, 6], "max_tokens": 2, "cache_salt": "salt\\ud800"}\n'
    got = http.post("/generate", content=line.encode(), headers=AUTH)
    assert got.status_code == 200, got.text
    (record,) = [json.loads(x) for x in got.text.splitlines()]
    assert record["finish_reason"] == "error" and "cache_salt" in (record["error"] or ""), record
    assert not hasattr(router, "submitted")  # nothing reached the router


# ---- error messages echo a wrong value whole (parse_body, check_model, TRL's logprobs, the query's
# 400): parsing.shown exists to bound them, and a 60 MiB field comes back as a 60 MiB error ----------
BIG = "x" * 200_000


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "n": BIG}),  # parse_body
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "model": BIG}),  # check_model
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "stop": [1] * 50_000}),
    ("/generate/", {"prompts": [[1, 2]], "generation_kwargs": {"logprobs": [1] * 50_000}}),  # trl._spec
])
def test_a_refused_value_is_not_echoed_whole(router, codec, path, body):  # noqa: F811
    got = post(app_over(router, codec), path, body)
    assert got.status_code in (400, 404, 422)
    assert len(got.content) < 2_000, f"{len(got.content)} bytes of error for a {len(json.dumps(body))}-byte body"


def test_a_bad_query_parameter_is_not_echoed_whole(router, codec):  # noqa: F811
    line = json.dumps({"prompt_token_ids": [5], "max_tokens": 2}) + "\n"
    got = app_over(router, codec).post("/generate?weights_version=" + "9" * 6000, content=line, headers=AUTH)
    assert got.status_code == 400 and "weights_version" in got.text
    assert len(got.content) < 2_000, len(got.content)


# ---- before any replica reported (the router's status has no "model": engines still loading, a
# fresh Gateway), a prompt text is tokenized whole however long: 5.5 MB took 7.7 s of the event loop,
# and its 3.5M ids were shipped to the router only to be refused there -----------------------------
def test_a_huge_text_is_not_tokenized_whole_while_no_replica_has_reported(codec, monkeypatch):  # noqa: F811
    from test_router_restart import Method

    router = TextRouter(codec)
    router.status = Method(lambda: {"model": None, "expected_replicas": 2, "replicas": {}})
    seen = []
    real = codec.encode
    monkeypatch.setattr(codec, "encode", lambda text, *a, **kw: (seen.append(len(text)), real(text, *a, **kw))[1])
    got = post(app_over(router, codec), "/v1/completions", {"prompt": "alpha beta " * 200_000, "max_tokens": 2})
    assert got.status_code in (400, 503), got.text
    assert not seen or max(seen) < 1_000_000, f"a {max(seen)}-character text was tokenized"
