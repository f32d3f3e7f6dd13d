"""/v1/chat/completions answers as vLLM 0.32's server writes them, where they differed: a stream
opens each choice with its role chunk (tests/test_stream_usage.py compares whole streams with
vLLM's own generator), the answer's role is the last message's where no generation prompt is
added, and a logprob's `bytes` are its token's text's."""
import json

import pytest

from test_protocols import SCRIPT, app_over, client, codec, http, router  # noqa: F401 (fixtures)
from test_gateway_review import post

MESSAGES = [{"role": "user", "content": "Hi"}]


def messages_from_stream(chunks) -> dict:
    """What a client that builds each choice's message from the chunks gets: the role from the
    chunk that names it, the content appended."""
    built = {}
    for chunk in chunks:
        for c in chunk.choices:
            m = built.setdefault(c.index, {"role": None, "content": ""})
            if c.delta.role is not None:
                assert m["role"] is None, f"choice {c.index}: a second role chunk"
                m["role"] = c.delta.role
            assert m["role"] is not None, f"choice {c.index}: content before its role"
            m["content"] += c.delta.content or ""
    return built


# ---- a chat stream sent no role: clients that build the message from the role chunk got none -------
def test_a_chat_stream_opens_each_choice_with_its_role(client, codec):  # noqa: F811
    chunks = list(client.chat.completions.create(model="models/tiny", messages=MESSAGES, n=2, max_tokens=3,
                                                 stream=True, stream_options={"include_usage": True}))
    text = codec.decode(codec.encode(SCRIPT)[:3])
    assert messages_from_stream(chunks) == {0: {"role": "assistant", "content": text},
                                            1: {"role": "assistant", "content": text}}
    assert [c.delta.content for ch in chunks[:2] for c in ch.choices] == ["", ""]  # before any text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


# ---- the role was "assistant" whatever add_generation_prompt said (vLLM: the last message's) ------
@pytest.mark.parametrize("stream", [False, True])
def test_without_a_generation_prompt_the_answer_continues_the_last_messages_role(router, codec, stream):  # noqa: F811
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

    said = MESSAGES + [{"role": "assistant", "content": "Hello"}, {"role": "tool", "content": "42"}]
    for add in (True, False):
        got = post(app_over(router, codec), "/v1/chat/completions", {"messages": said, "max_tokens": 2,
                                                                     "add_generation_prompt": add, "stream": stream})
        assert got.status_code == 200, got.text
        if stream:
            role = json.loads(got.text.split("\n\n")[0][len("data: "):])["choices"][0]["delta"]["role"]
        else:
            role = got.json()["choices"][0]["message"]["role"]
        server = object.__new__(OpenAIServingChat)
        server.response_role = "assistant"
        request = ChatCompletionRequest(model="m", messages=said, add_generation_prompt=add)
        assert role == server.get_chat_request_role(request) == ("assistant" if add else said[-1]["role"])


# ---- return_tokens_as_token_ids made a logprob's bytes those of "token_id:N" (vLLM: the token's text's)
def test_logprob_bytes_are_the_tokens_text_even_as_token_ids(client, codec):  # noqa: F811
    for as_ids in (False, True):
        out = client.chat.completions.create(model="models/tiny", messages=MESSAGES, max_tokens=4, logprobs=True,
                                             extra_body={"return_tokens_as_token_ids": as_ids,
                                                         "return_token_ids": True})
        (c,) = out.choices
        ids = c.model_extra["token_ids"]
        texts = codec.token_texts(ids)
        assert [x.token for x in c.logprobs.content] == ([f"token_id:{t}" for t in ids] if as_ids else texts)
        assert [bytes(x.bytes).decode() for x in c.logprobs.content] == texts
