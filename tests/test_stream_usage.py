"""stream_options as vLLM's server reads it (vllm/entrypoints/serve/utils/api_utils.py's
should_include_usage): `include_usage` adds a last chunk with the request's usage, and
`continuous_usage_stats` (with include_usage only) puts the usage so far on every chunk. Each
stream here is compared with what vLLM's own stream generators (OpenAIServingCompletion's and
OpenAIServingChat's) write when the engine hands them each choice whole, as this server sends it
(the chat stream chunk for chunk: its role chunks, logprobs and token ids too); stream_options
without stream is refused as vLLM's request models refuse it."""
import asyncio
import json
from types import SimpleNamespace

import pytest

from test_gateway_review import post
from test_protocols import app_over, codec, router  # noqa: F401 (fixtures)

vllm_completion = pytest.importorskip("vllm.entrypoints.openai.completion.serving")
vllm_chat = pytest.importorskip("vllm.entrypoints.openai.chat_completion.serving")
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest  # noqa: E402
from vllm.entrypoints.openai.completion.protocol import CompletionRequest  # noqa: E402
from vllm.exceptions import VLLMValidationError  # noqa: E402
from vllm.logprobs import Logprob  # noqa: E402
from vllm.outputs import CompletionOutput, RequestOutput  # noqa: E402

OPTIONS = [None, {}, {"include_usage": True}, {"include_usage": True, "continuous_usage_stats": True},
           {"include_usage": False, "continuous_usage_stats": True}, {"continuous_usage_stats": True},
           {"include_usage": True, "continuous_usage_stats": False}]
MESSAGES = [{"role": "user", "content": "alpha beta gamma"}]


def _server(cls, **extra):
    """vLLM's serving object with only what its stream generator reads (no engine, no parser)."""
    server = object.__new__(cls)
    for key, value in dict(enable_force_include_usage=False, system_fingerprint=None, enable_prompt_tokens_details=False,
                           enable_per_request_metrics=False, **extra).items():
        setattr(server, key, value)
    return server


def _output(prompt_ids, choice, logprobs=None) -> RequestOutput:
    """One engine step that hands one choice whole (as this server's stream sends it)."""
    ids = choice["token_ids"]
    return RequestOutput(request_id="r", prompt="-", prompt_token_ids=prompt_ids, prompt_logprobs=None, finished=True,
                         outputs=[CompletionOutput(index=choice["index"], text=choice.get("text") or "",
                                                   token_ids=ids, cumulative_logprob=None, logprobs=logprobs,
                                                   finish_reason=choice["finish_reason"],
                                                   stop_reason=choice.get("stop_reason"))])


def _events(text: str) -> list:
    assert text.endswith("data: [DONE]\n\n"), text
    return [json.loads(e[len("data: "):]) for e in text.split("\n\n")[:-2]]


def _collect(agen) -> list:
    async def run():
        return [line async for line in agen]
    events = _events("".join(asyncio.run(run())))
    assert not any("error" in e for e in events), events
    return events


def _ours(http, path, body) -> list:
    got = post(http, path, body)
    assert got.status_code == 200, got.text
    return _events(got.text)


@pytest.mark.parametrize("options", OPTIONS)
def test_completion_stream_usage_is_vllms(router, codec, options):  # noqa: F811
    prompts = ["alpha", "beta gamma delta epsilon"]
    body = {"prompt": prompts, "n": 2, "max_tokens": 3, "stream": True, "return_token_ids": True,
            **({} if options is None else {"stream_options": options})}
    ours = _ours(app_over(router, codec), "/v1/completions", body)
    per_prompt = {c["index"] // 2: c["prompt_token_ids"] for e in ours for c in e["choices"]}
    assert [len(per_prompt[0]), len(per_prompt[1])] == [len(codec.encode(p)) for p in prompts]

    async def steps():
        for e in ours:
            for c in e["choices"]:
                yield c["index"] // 2, _output(per_prompt[c["index"] // 2], {**c, "index": c["index"] % 2})
    request = CompletionRequest(model="m", prompt=prompts, n=2, max_tokens=3, stream=True, stream_options=options)
    theirs = _collect(_server(vllm_completion.OpenAIServingCompletion).completion_stream_generator(
        request, [None, None], steps(), "cmpl-1", 0, "m", 2, None, SimpleNamespace(final_usage_info=None)))
    assert [e.get("usage", "absent") for e in ours] == [e.get("usage", "absent") for e in theirs]
    assert [[c["index"] for c in e["choices"]] for e in ours] == [[c["index"] for c in e["choices"]] for e in theirs]


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("extra", [{}, {"return_token_ids": True}, {"logprobs": True, "top_logprobs": 0},
                                   {"logprobs": True, "return_tokens_as_token_ids": True, "return_token_ids": True}])
def test_chat_stream_is_vllms_chunk_for_chunk(router, codec, options, extra):  # noqa: F811
    """vLLM's chat stream first sends each choice a role chunk (delta {"role": "assistant",
    "content": ""}, no logprobs, the prompt's ids, usage with 0 completion tokens), then its text:
    ours, its choices handed to vLLM's own generator as engine outputs, is the same chunk for chunk
    (all but `created`), usage, logprobs and token ids included."""
    n, max_tokens = 3, 4
    body = {"messages": MESSAGES, "n": n, "max_tokens": max_tokens, "stream": True, "request_id": "1", **extra,
            **({} if options is None else {"stream_options": options})}
    ours = _ours(app_over(router, codec), "/v1/chat/completions", body)
    prompt = codec.encode(codec.render_chat(MESSAGES), add_special_tokens=False)
    ids = router.script[:max_tokens]
    logprobs = [{t: Logprob(-0.5, 1, text)} for t, text in zip(ids, codec.token_texts(ids))]

    async def steps():
        for e in ours[n:]:
            for c in e["choices"]:
                yield _output(prompt, {**c, "text": c["delta"]["content"], "token_ids": ids}, logprobs)
    request = ChatCompletionRequest(model="m", messages=MESSAGES, n=n, max_tokens=max_tokens, stream=True,
                                    stream_options=options, **extra)
    server = _server(vllm_chat.OpenAIServingChat, parser_cls=None, _include_reasoning_tokens_details=False,
                     enable_log_outputs=False, request_logger=None, response_role="assistant",
                     return_tokens_as_token_ids=False)
    theirs = _collect(server.chat_completion_stream_generator(request, steps(), "chatcmpl-1", "models/tiny", [],
                                                              None, SimpleNamespace(final_usage_info=None)))
    assert [e["choices"][0]["delta"] for e in ours[:n]] == [{"role": "assistant", "content": ""}] * n
    assert [{**e, "created": 0} for e in ours] == [{**e, "created": 0} for e in theirs]


@pytest.mark.parametrize("options", [None, {}, {"include_usage": False}, {"continuous_usage_stats": True},
                                     {"other": 1}])
@pytest.mark.parametrize("path, body, vllm_model", [
    ("/v1/completions", {"prompt": "alpha", "max_tokens": 2}, CompletionRequest),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2}, ChatCompletionRequest)])
def test_stream_options_without_stream_is_refused_as_vllm_refuses_it(router, codec, options, path, body,
                                                                     vllm_model):  # noqa: F811
    full = {**body, "model": "m", "stream_options": options}
    try:
        vllm_model.model_validate(full)
        vllm_refuses = False
    except (ValueError, VLLMValidationError):
        vllm_refuses = True
    got = post(app_over(router, codec), path, {**body, "stream_options": options})
    assert (got.status_code == 400) == vllm_refuses, got.text
    if vllm_refuses:
        assert got.json()["error"]["param"] == "stream_options"


@pytest.mark.parametrize("options", [{"include_usage": "yes"}, {"continuous_usage_stats": 1}, "include_usage"])
def test_stream_options_of_the_wrong_type_are_refused_naming_them(router, codec, options):  # noqa: F811
    got = post(app_over(router, codec), "/v1/completions", {"prompt": "alpha", "stream": True,
                                                            "stream_options": options})
    assert got.status_code == 400 and got.json()["error"]["param"].startswith("body.stream_options"), got.text
