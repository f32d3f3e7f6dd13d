"""The Gateway's HTTP routes at their edges (serve/gateway.py, serve/protocols/): stop token ids
past the vocabulary refused before they reach an engine, stop strings without a tokenizer refused
rather than ignored, TRL's /chat/ with add_generation_prompt in its template kwargs, values that
mean vLLM's default taken, refusals naming the field the client sent."""
import json

import pytest

from test_protocols import AUTH, TextRouter, app_over, codec, router  # noqa: F401 (fixtures)

CHAT = [{"role": "user", "content": "hi"}]


def post(http, path, body, headers=None):
    return http.post(path, content=body if isinstance(body, str) else json.dumps(body),
                     headers={**AUTH, "content-type": "application/json", **(headers or {})})


def refused_naming(got, field: str) -> bool:
    """A 400 (OpenAI's shape) or 422 (TRL's shape) whose answer names `field`."""
    return got.status_code in (400, 422) and field in got.text


# ---- stop_token_ids are never checked against the vocabulary ---------------------------------------
# The fake replica's engine says vocab_size=1000 (ModelInfo(1000, 4096)). Prompt ids past it are
# refused (validation.check_request); stop ids are not, so they reach the engine. vLLM indexes the
# logits with them (min_tokens / EOS masking: logits.index_put_((rows, all_stop_token_ids), -inf));
# the pinned vllm==0.26.0 predates the check vLLM added for it (vllm#54196), and an out-of-vocab
# stop id with min_tokens >= 1 is a device-side assert that kills the engine (vllm#54195, #42614).
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 3, "min_tokens": 1, "stop_token_ids": [5000]}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "min_tokens": 1, "stop_token_ids": [2, 5000]}),
    ("/generate/", {"prompts": [[1, 2]], "max_tokens": 3,
                    "generation_kwargs": {"min_tokens": 1, "stop_token_ids": [5000]}}),
])
def test_stop_token_ids_outside_the_vocabulary_are_refused_naming_stop_token_ids(router, codec, path, body):
    got = post(app_over(router, codec), path, body)
    assert refused_naming(got, "stop_token_ids"), got.text
    assert not hasattr(router, "submitted")  # nothing reached the router


def test_a_jsonl_line_with_a_stop_token_id_outside_the_vocabulary_is_an_error_line(router, codec):
    lines = (json.dumps({"prompt_token_ids": [1, 2], "max_tokens": 2, "min_tokens": 1, "stop_token_ids": [5000]})
             + "\n" + json.dumps({"prompt_token_ids": [1, 2], "max_tokens": 2}) + "\n")
    got = app_over(router, codec).post("/generate", content=lines, headers=AUTH)
    assert got.status_code == 200, got.text
    first, second = [json.loads(line) for line in got.text.splitlines()]
    assert first["finish_reason"] == "error" and "stop_token_ids" in first["error"], first
    assert second["finish_reason"] == "length"  # the rest still runs


# ---- without a tokenizer, stop strings are silently ignored -----------------------------------------
# outputs.output_of returns at once when ctx.codec is None, so `stop` never cuts anything: the
# request runs to max_tokens and answers finish_reason "length". vLLM refuses stop strings it cannot
# apply ("stop strings are only supported when detokenize is True"); text prompts are refused here too.
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [3, 4], "max_tokens": 6, "stop": ["beta"]}),
    ("/generate/", {"prompts": [[3, 4]], "max_tokens": 6, "generation_kwargs": {"stop": ["beta"]}}),
])
def test_stop_strings_without_a_tokenizer_are_refused_not_ignored(router, path, body):
    got = post(app_over(router, None), path, body)
    assert refused_naming(got, "stop"), got.text
    assert not hasattr(router, "submitted")


# ---- TRL's /chat/: add_generation_prompt in chat_template_kwargs is a 422 from a TypeError -------------
# The OpenAI route drops it from chat_template_kwargs (ChatBody.template_kwargs); /chat/ passes it to
# TextCodec.render_chat next to its own add_generation_prompt argument: "got multiple values for argument".
# vLLM's LLM.chat, behind `trl vllm-serve`, merges the two and renders.
def test_trl_chat_takes_add_generation_prompt_in_chat_template_kwargs(router, codec):
    http = app_over(router, codec)
    plain = post(http, "/chat/", {"messages": [CHAT], "max_tokens": 2})
    got = post(http, "/chat/", {"messages": [CHAT], "max_tokens": 2,
                                "chat_template_kwargs": {"add_generation_prompt": True}})
    assert got.status_code == 200, got.text
    assert got.json()["prompt_ids"] == plain.json()["prompt_ids"]


# ---- values that mean vLLM's default are refused as if they asked for something ----------------------
# REFUSED accepts None/False only: logit_bias {} (no bias: vLLM's `if not self.logit_bias: return`)
# and response_format {"type": "text"} (vLLM's structured_outputs_from_response_format: none) are
# what clients send for "nothing", and vLLM serves them as such.
@pytest.mark.parametrize("path, extra", [
    ("/v1/completions", {"logit_bias": {}}),
    ("/v1/chat/completions", {"logit_bias": {}}),
    ("/v1/chat/completions", {"response_format": {"type": "text"}}),
])
def test_a_no_op_value_vllm_serves_as_its_default_is_not_refused(router, codec, path, extra):
    body = {"prompt": [1, 2]} if path == "/v1/completions" else {"messages": CHAT}
    got = post(app_over(router, codec), path, {**body, "max_tokens": 2, **extra})
    assert got.status_code == 200, got.text


# ---- a refusal names a field the request did not send -----------------------------------------------
def test_a_chat_refusal_of_max_completion_tokens_names_max_completion_tokens(router, codec):
    http = app_over(router, codec)
    for value in (0, 5000):  # below 1; past the context (max_model_len 4096)
        got = post(http, "/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": value})
        assert got.status_code == 400, got.text
        assert got.json()["error"]["param"] == "max_completion_tokens", got.text


def test_a_long_openai_user_is_not_refused_as_a_session_the_request_never_named(router, codec):
    # vLLM ignores `user`; here it is the session key (session_of), and one past MAX_SESSION_CHARS
    # (256) is refused as "session=...", a field neither OpenAI's API nor the request has.
    got = post(app_over(router, codec), "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "user": "u" * 300})
    assert got.status_code == 200 or got.json()["error"]["param"] == "user", got.text


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [3, 4], "max_tokens": 2, "stop": ""}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "stop": ["x", ""]}),
    ("/generate/", {"prompts": [[3, 4]], "max_tokens": 2, "generation_kwargs": {"stop": [""]}}),
])
def test_an_empty_stop_string_is_refused_as_vllm_refuses_it(router, codec, path, body):
    got = post(app_over(router, codec), path, body)
    assert refused_naming(got, "stop") and "empty string" in got.text, got.text
    assert not hasattr(router, "submitted")
