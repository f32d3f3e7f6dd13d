"""Chat messages as vLLM 0.32 renders them (serve/protocols/chat_messages.py): agent histories with
tool calls (`content: null`, `tool_call_id`, arguments as OpenAI's JSON string), reasoning, names,
text parts. Each accepted conversation is compared with what vLLM's own request model and
`parse_chat_messages` hand the template, and rendered through a Qwen2.5-style tool template both
ways (ours, and vLLM's safe_apply_chat_template over Hugging Face's tokenizer); each refused one is
refused by vLLM too, and named here by its field."""
import copy
from types import SimpleNamespace

import pytest

from rollout_cluster.serve.protocols.chat_messages import template_messages
from rollout_cluster.serve.protocols.context import ProtocolError
from rollout_cluster.text.codec import TextCodec
from rollout_cluster.text.make_tokenizer import make_tokenizer
from test_gateway_review import post
from test_protocols import TextRouter, app_over

vllm_chat = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
vllm_parse = pytest.importorskip("vllm.renderers.chat_utils")
vllm_hf = pytest.importorskip("vllm.renderers.hf")
# the two fields of vLLM's ModelConfig that parsing text-only messages reads (no model is loaded)
TEXT_MODEL = SimpleNamespace(enable_prompt_embeds=False, multimodal_config=None)
# Qwen2.5's tool-call layout, cut down: arguments through `tojson`, as the real template writes them
QWEN_STYLE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}<|im_end|>\n"
    "{%- endif %}{%- for message in messages %}{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant' }}{% if message.reasoning_content %}{{ '\n<think>' + message.reasoning_content"
    " + '</think>' }}{% endif %}{% if message.content %}{{ '\n' + message.content }}{% endif %}"
    "{%- for tool_call in message.tool_calls or [] %}{%- if tool_call.function is defined %}"
    "{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\n<tool_call>\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}"
    "{{- '}\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}{{- '<|im_start|>user\n<tool_response id=' + (message.tool_call_id or '-')"
    " + '>\n' + message.content + '\n</tool_response><|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + (' name=' + message.name if message.name else '') + '\n'"
    " + message.content + '<|im_end|>\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
HISTORY = [  # an agent's 4 turns, as an OpenAI client sends them back
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18C"}, {"type": "text",
                                                                                            "text": "sunny"}]},
    {"role": "user", "content": "And tomorrow?"}]


def call(arguments, **extra) -> list:
    return [{**CALL, **extra, "function": {**CALL["function"], "arguments": arguments}}]


def said(**message) -> list:
    return [{"role": "user", "content": "hi"}, message]


ACCEPTED = {
    "agent history": HISTORY,
    "malformed arguments": said(role="assistant", content="", tool_calls=call("{bad json")),
    "a list as arguments": said(role="assistant", content="", tool_calls=call("[1, 2]")),
    "a number as arguments": said(role="assistant", content=None, tool_calls=call("42")),
    "null as arguments": said(role="assistant", content=None, tool_calls=call("null")),
    "empty arguments": said(role="assistant", content=None, tool_calls=call("")),
    "nested arguments": said(role="assistant", content=None, tool_calls=call('{"a": {"b": [1, "é"]}}')),
    "two calls, extra keys kept": said(role="assistant", content="ok", tool_calls=call('{"x": 1}', index=0) + [
        {"id": "c2", "type": "function", "function": {"name": "f", "arguments": "{}", "strict": True}}]),
    "no content key": said(role="assistant", tool_calls=call("{}")),
    "empty tool_calls dropped": said(role="assistant", content="x", tool_calls=[]),
    "null tool_calls with text": said(role="assistant", content="x", tool_calls=None),
    "reasoning": said(role="assistant", content="x", reasoning="think first"),
    "reasoning_content renamed": said(role="assistant", content=None, reasoning_content="r", tool_calls=call("{}")),
    "reasoning over reasoning_content": said(role="assistant", content="x", reasoning="a", reasoning_content="b"),
    "reasoning on a user dropped": [{"role": "user", "content": "x", "reasoning": "r", "reasoning_content": "r"}],
    "names": [{"role": "user", "content": "x", "name": "alice"},
              {"role": "assistant", "content": None, "name": "bot", "tool_calls": call("{}")}],
    "null tool_call_id": said(role="tool", content="r", tool_call_id=None),
    "tool without id, named": said(role="tool", content="r", name="get_weather"),
    "text parts joined": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": ""}, "b", {"type": "refusal", "refusal": "c"},
        {"type": "input_text", "text": "d"}, {"type": "output_text", "text": "e"},
        {"type": "thinking", "thinking": "f"},
        {"type": "tool_reference", "name": "g"}, {"type": "tool_reference"},
        {"type": "text", "text": "h", "uuid": None}]}],
    "tool parts joined": said(role="tool", tool_call_id="c", content=[{"type": "text", "text": "1"}, "2"]),
    "no parts": [{"role": "user", "content": []}],
    "no content": [{"role": "user"}],
    "other keys dropped": [{"role": "user", "content": "x", "foo": 1, "tool_call_id": "c", "tool_calls": call("{}"),
                            "task": 5}],
    "billing header": [{"role": "system", "content": "x-anthropic-billing-header: cch=1\nBe brief."},
                       {"role": "user", "content": "x"}],
    "developer": [{"role": "system", "content": "s"}, {"role": "developer", "content": "d", "tools": []},
                  {"role": "user", "content": "x", "task": "t"}],
    "custom role": [{"role": "narrator", "content": "Once", "name": "n"}],
}


def vllm_conversation(messages) -> list:
    """What vLLM's server hands the template: its request model, then parse_chat_messages ("string")."""
    request = vllm_chat.ChatCompletionRequest(messages=copy.deepcopy(messages), model="m")
    return vllm_parse.parse_chat_messages(request.messages, TEXT_MODEL, "string")[0]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return make_tokenizer(str(tmp_path_factory.mktemp("tok")), vocab_size=1000)


@pytest.fixture(scope="module")
def qwen(tok_dir):
    codec = TextCodec.load(str(tok_dir))
    return TextCodec(codec.tokenizer, QWEN_STYLE, codec.special)


@pytest.fixture(scope="module")
def vllm_prompt(tok_dir):
    """The prompt text vLLM renders (safe_apply_chat_template over Hugging Face's tokenizer)."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(tok_dir))
    return lambda messages, template=QWEN_STYLE, tools=None: vllm_hf.safe_apply_chat_template(
        TEXT_MODEL, hf, vllm_conversation(messages), chat_template=template, tools=tools, tokenize=False,
        add_generation_prompt=True)


@pytest.mark.parametrize("name", ACCEPTED)
def test_messages_reach_the_template_as_vllm_hands_them(name):
    messages = copy.deepcopy(ACCEPTED[name])
    assert template_messages(messages, "messages") == vllm_conversation(ACCEPTED[name])
    assert messages == ACCEPTED[name]  # the request's own dicts are left as they came


@pytest.mark.parametrize("name", ACCEPTED)
def test_the_rendered_prompt_is_vllms(name, qwen, vllm_prompt):
    ours = qwen.render_chat(template_messages(ACCEPTED[name], "messages", QWEN_STYLE), True)
    assert ours == vllm_prompt(ACCEPTED[name])


def test_tool_call_arguments_render_once_encoded(qwen, vllm_prompt):
    text = qwen.render_chat(template_messages(HISTORY, "messages", QWEN_STYLE), True)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text and '\\"city' not in text
    assert "<tool_response id=call_1>\n18C\nsunny\n</tool_response>" in text
    raw = qwen.render_chat([dict(m, content=m["content"] or "") for m in HISTORY[:2]], True)  # as it was: a string
    assert '"arguments": "{\\"city\\": \\"Paris\\"}"' in raw  # twice encoded: what this fixes
    malformed = qwen.render_chat(template_messages(ACCEPTED["malformed arguments"], "messages"), True)
    assert '"arguments": {}}' in malformed and malformed == vllm_prompt(ACCEPTED["malformed arguments"])


def test_a_developer_message_becomes_system_where_the_template_has_no_developer_role(qwen, vllm_prompt):
    messages = ACCEPTED["developer"]
    got = template_messages(messages, "messages", QWEN_STYLE)
    assert got == [{"role": "system", "content": "s\n\nd"}, {"role": "user", "content": "x", "task": "t"}]
    assert qwen.render_chat(got, True) == vllm_prompt(messages)
    own = "{#- a 'developer' message renders as it came #}" + QWEN_STYLE  # vLLM looks for the quoted role
    assert [m["role"] for m in template_messages(messages, "messages", own)] == ["system", "developer", "user"]
    rendered = TextCodec(qwen.tokenizer, own, qwen.special).render_chat(template_messages(messages, "messages", own))
    assert "<|im_start|>developer\nd<|im_end|>" in rendered and rendered == vllm_prompt(messages, own)


REFUSED = [
    (said(role="user", content=None), "messages[1].content"),
    (said(role="tool", content=None, tool_call_id="c"), "messages[1].content"),
    (said(role="system", content=None), "messages[1].content"),
    (said(role="assistant", content=None, tool_calls=None), "messages[1].tool_calls"),
    (said(role="assistant", content="", tool_calls={"id": "c"}), "messages[1].tool_calls"),
    (said(role="assistant", content="", tool_calls=[5]), "messages[1].tool_calls[0]"),
    (said(role="assistant", content="", tool_calls=[CALL, {"id": "c", "type": "custom", "custom": {
        "name": "f", "input": "x"}}]), "messages[1].tool_calls[1].type"),
    (said(role="assistant", content="", tool_calls=[{"id": "c", "function": CALL["function"]}]),
     "messages[1].tool_calls[0].type"),
    (said(role="assistant", content="", tool_calls=[{"type": "function", "function": CALL["function"]}]),
     "messages[1].tool_calls[0].id"),
    (said(role="assistant", content="", tool_calls=call("{}", id=7)), "messages[1].tool_calls[0].id"),
    (said(role="assistant", content="", tool_calls=[{"id": "c", "type": "function"}]),
     "messages[1].tool_calls[0].function"),
    (said(role="assistant", content="", tool_calls=[{"id": "c", "type": "function", "function": {
        "name": 3, "arguments": "{}"}}]), "messages[1].tool_calls[0].function.name"),
    (said(role="assistant", content=None, tool_calls=call({"city": "Paris"})),
     "messages[1].tool_calls[0].function.arguments"),
    (said(role="assistant", content=None, tool_calls=call(None)), "messages[1].tool_calls[0].function.arguments"),
    (said(role="assistant", content=None, tool_calls=[{"id": "c", "type": "function", "function": {"name": "f"}}]),
     "messages[1].tool_calls[0].function.arguments"),
    (said(role="user", content="x", name=5), "messages[1].name"),
    (said(role="user", content="x", name=None), "messages[1].name"),
    (said(role="tool", content="x", tool_call_id=5), "messages[1].tool_call_id"),
    (said(content="x"), "messages[1].role"),
    (said(role=1, content="x"), "messages[1].role"),
    (said(role="user", content=5), "messages[1].content"),
    (said(role="user", content=[{"type": "text", "text": None}]), "messages[1].content[0].text"),
    (said(role="user", content=[{"type": "thinking", "thinking": 1}]), "messages[1].content[0].thinking"),
    (said(role="user", content=["ok", {"text": "x"}]), "messages[1].content[1].type"),
    (said(role="user", content=[{"type": "html", "html": "x"}]), "messages[1].content[0].type"),
    (said(role="user", content=[{"type": ["text"], "text": "x"}]), "messages[1].content[0].type"),
    (said(role="user", content=[{"type": "text", "text": "x", "uuid": "u"}]), "messages[1].content[0].uuid"),
    (said(role="user", content=[{"type": "file", "file": {"file_id": "f"}}]), "messages[1].content[0]"),
    (said(role="user", content=[7]), "messages[1].content[0]"),
]


@pytest.mark.parametrize("messages, field", REFUSED, ids=[f for _, f in REFUSED])
def test_what_vllm_refuses_is_refused_naming_the_field(messages, field):
    with pytest.raises((ValueError, vllm_parse.VLLMValidationError)):  # pydantic's ValidationError is a ValueError
        vllm_conversation(messages)
    with pytest.raises(ProtocolError) as e:
        template_messages(messages, "messages")
    assert (e.value.status, e.value.param) == (400, field) and e.value.message.startswith(field)


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "data:,"}},
                                  {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
                                  {"video_url": {"url": "data:,"}}])
def test_media_parts_are_refused_by_name(part):
    with pytest.raises(ProtocolError) as e:
        template_messages(said(role="user", content=["look", part]), "messages")
    assert e.value.param == "messages[1].content[1]" and "only text parts" in e.value.message


def test_a_reasoning_that_is_no_string_is_refused_where_vllm_renders_it():
    messages = said(role="assistant", content="x", reasoning=5)
    assert vllm_conversation(messages)[1]["reasoning"] == 5  # its union of message types lets it through
    with pytest.raises(ProtocolError) as e:
        template_messages(messages, "messages")
    assert e.value.param == "messages[1].reasoning"


# ---- through the routes ------------------------------------------------------------------------
@pytest.fixture
def qwen_app(qwen):
    router = TextRouter(qwen)
    return router, app_over(router, qwen)


def test_an_agent_history_goes_through_openai_chat_and_trl_chat(qwen, qwen_app, vllm_prompt):
    router, http = qwen_app
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    expected = qwen.encode(vllm_prompt(HISTORY, tools=tools), add_special_tokens=False)
    got = post(http, "/v1/chat/completions", {"messages": HISTORY, "tools": tools, "max_tokens": 2})
    assert got.status_code == 200, got.text
    assert router.submitted[0].prompt_token_ids == expected
    got = post(http, "/chat/", {"messages": [HISTORY, HISTORY[:1]], "tools": tools, "max_tokens": 2})
    assert got.status_code == 200, got.text
    assert got.json()["prompt_ids"] == [expected, qwen.encode(vllm_prompt(HISTORY[:1], tools=tools),
                                                              add_special_tokens=False)]


def test_the_routes_refuse_a_bad_tool_call_naming_the_field(qwen_app):
    router, http = qwen_app
    bad = HISTORY[:1] + said(role="assistant", content=None, tool_calls=call({"city": "Paris"}))[1:]
    got = post(http, "/v1/chat/completions", {"messages": bad, "max_tokens": 2})
    assert got.status_code == 400 and got.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"
    got = post(http, "/chat/", {"messages": [HISTORY, bad], "max_tokens": 2})
    assert got.status_code == 422
    assert got.json()["detail"][0]["loc"] == ["body", "messages[1][1].tool_calls[0].function.arguments"]
    assert not hasattr(router, "submitted")  # nothing ran
