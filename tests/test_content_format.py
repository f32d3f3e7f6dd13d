"""A chat template that loops over a message's content parts (vLLM's "openai" content format) is
handed the parts, as vLLM's server hands them; one that does not ("string") the joined text.
Regression: every template was handed the joined text, so a template that loops over
`message.content` (Gemma 3, Qwen2.5-VL, Qwen3.5/3.6, SmolVLM, ...) iterated a string's characters.
The detection is compared with vLLM's own (renderers/hf.py `_detect_content_format`) on every chat
template TRL and vLLM ship and on edge cases; the messages with vLLM's parse_chat_messages in the
"openai" format; the rendered prompt with vLLM's safe_apply_chat_template, through the route."""
import copy
import glob
import importlib.util
import os

import pytest

from rollout_cluster.serve.protocols.chat_messages import template_messages
from rollout_cluster.text.codec import TextCodec
from rollout_cluster.text.content_format import content_format
from test_chat_messages import ACCEPTED, QWEN_STYLE, TEXT_MODEL, qwen, tok_dir  # noqa: F401 (fixtures)
from test_gateway_review import post
from test_protocols import TextRouter, app_over

vllm_chat = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
vllm_parse = pytest.importorskip("vllm.renderers.chat_utils")
vllm_hf = pytest.importorskip("vllm.renderers.hf")
TRL_TEMPLATES = os.path.join(os.path.dirname(importlib.util.find_spec("trl").origin), "chat_templates")
VLLM_TEMPLATES = os.path.join(os.path.dirname(importlib.util.find_spec("vllm").origin), "transformers_utils",
                              "chat_templates")
SHIPPED = sorted(glob.glob(f"{TRL_TEMPLATES}/*.jinja") + glob.glob(f"{VLLM_TEMPLATES}/*.jinja"))
# a template that loops over the parts and takes a string too; tool calls' arguments through tojson
PARTS = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}{% if message.name %} name={{ message.name }}"
    "{% endif %}\n{%- if message.content is string %}{{ message.content }}{% else %}"
    "{% for part in message.content %}{% if part.type == 'text' %}[{{ part.text }}]{% else %}"
    "<{{ part.type }}:{{ part.name }}>{% endif %}{% endfor %}{% endif %}"
    "{%- for call in message.tool_calls or [] %}\n<call>{{ call.function.name }} {{ call.function.arguments | tojson }}"
    "</call>{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
EDGE = {
    "parts": PARTS,
    "string": QWEN_STYLE,
    "alias of messages": "{% set ms = messages[1:] %}{% for m in ms %}{% for p in m['content'] %}{{ p.text }}"
                         "{% endfor %}{% endfor %}",
    "through a filter": "{% for m in messages %}{% for p in m.content | list %}{{ p }}{% endfor %}{% endfor %}",
    "a content variable": "{% for m in messages %}{% set content = m.content %}{% for p in content %}{{ p }}"
                          "{% endfor %}{% endfor %}",
    "a macro parameter": "{% macro render(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
                         "{% for m in messages %}{{ render(m.content) }}{% endfor %}",
    "a macro keyword": "{% macro render(x, c=none) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}"
                       "{% for m in messages %}{{ render(1, c=m['content']) }}{% endfor %}",
    "a macro not given content": "{% macro render(c) %}{% for p in c %}{{ p }}{% endfor %}{% endmacro %}"
                                 "{% for m in messages %}{{ render(m.role) }}{% endfor %}",
    "content tested": "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% endif %}{% endfor %}",
    "a tuple target": "{% for m in messages %}{% for a, b in m.content %}{{ a }}{% endfor %}{% endfor %}",
    "a generation block": "{% for m in messages %}{% generation %}{% for p in m.content %}{{ p.text }}{% endfor %}"
                          "{% endgeneration %}{% endfor %}",
    "does not parse": "{% for m in messages %}{{ m.content }",
    "no messages loop": "{% for p in messages[0].content %}{{ p }}{% endfor %}",
}
# conversations whose parts the "openai" format keeps apart (with ACCEPTED's)
PART_CASES = {
    "extra keys on a part": [{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {"t": 1}},
                                                          {"type": "refusal", "refusal": "r", "x": 2}]}],
    "billing header part dropped": [{"role": "system", "content": [
        {"type": "text", "text": "x-anthropic-billing-header: cch=1"}, {"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "hi"}],
    "tool result with an empty part": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c",
                                        "content": [{"type": "text", "text": "a"}, {"type": "text", "text": ""}]}],
    "tool result with a reference": [{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "c",
                                      "content": [{"type": "text", "text": "a"}, {"type": "tool_reference",
                                                                                   "name": "t"}]}],
    "developer parts merged": [{"role": "system", "content": [{"type": "text", "text": "s1"}, "s2"]},
                               {"role": "developer", "content": [{"type": "text", "text": "d"}]},
                               {"role": "user", "content": [{"type": "text", "text": "x"}]}],
}
CASES = {**ACCEPTED, **PART_CASES}


def vllm_conversation(messages, fmt: str) -> list:
    request = vllm_chat.ChatCompletionRequest(messages=copy.deepcopy(messages), model="m")
    return vllm_parse.parse_chat_messages(request.messages, TEXT_MODEL, fmt)[0]


@pytest.mark.parametrize("path", SHIPPED, ids=[os.path.basename(p) for p in SHIPPED])
def test_a_shipped_template_is_detected_as_vllm_detects_it(path):
    template = open(path).read()
    assert content_format(template) == vllm_hf._detect_content_format(template, default="string")


@pytest.mark.parametrize("name", EDGE)
def test_an_edge_case_template_is_detected_as_vllm_detects_it(name):
    assert content_format(EDGE[name]) == vllm_hf._detect_content_format(EDGE[name], default="string")


def test_both_formats_are_among_the_shipped_templates():  # the comparison above covers both answers
    found = {content_format(open(p).read()) for p in SHIPPED}
    assert found == {"string", "openai"}, SHIPPED


@pytest.mark.parametrize("name", CASES)
def test_parts_reach_an_openai_format_template_as_vllm_hands_them(name):
    messages = copy.deepcopy(CASES[name])
    assert template_messages(messages, "messages", None, "openai") == vllm_conversation(CASES[name], "openai")
    assert template_messages(messages, "messages", None, "string") == vllm_conversation(CASES[name], "string")
    assert messages == CASES[name]  # the request's own dicts are left as they came


@pytest.fixture(scope="module")
def hf_tokenizer(tok_dir):  # noqa: F811
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(str(tok_dir))


def vllm_prompt(hf, messages, template) -> str:
    """vLLM's server: the format detected, the messages parsed in it, the template applied."""
    fmt = vllm_hf._detect_content_format(template, default="string")
    return vllm_hf.safe_apply_chat_template(TEXT_MODEL, hf, vllm_conversation(messages, fmt), chat_template=template,
                                            tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("template", ["parts", "string", "qwen3_6.jinja", "gemma3.jinja", "qwen2_5.jinja"])
@pytest.mark.parametrize("name", CASES)
def test_the_route_renders_the_prompt_vllm_renders(name, template, qwen, hf_tokenizer):  # noqa: F811
    source = EDGE.get(template) or open(f"{TRL_TEMPLATES}/{template}").read()
    try:
        want = vllm_prompt(hf_tokenizer, CASES[name], source)
    except Exception as e:  # the template itself refuses the conversation (its raise_exception): so must ours
        want = e
    codec = TextCodec(qwen.tokenizer, source, qwen.special)
    router = TextRouter(codec)
    got = post(app_over(router, codec), "/v1/chat/completions", {"messages": CASES[name], "max_tokens": 1})
    if isinstance(want, Exception):
        assert got.status_code == 400 and "chat template" in got.json()["error"]["message"], (want, got.text)
        return
    assert got.status_code == 200, got.text
    assert router.submitted[0].prompt_token_ids == codec.encode(want, add_special_tokens=False)


def test_an_openai_format_template_iterated_a_strings_characters_before(qwen):  # noqa: F811
    """The regression itself: handed the joined string, a template that loops over the content
    looped over its characters."""
    loop = "{% for m in messages %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endfor %}"
    codec = TextCodec(qwen.tokenizer, loop, qwen.special)
    said = [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]}]
    assert content_format(loop) == "openai"
    assert codec.render_chat(template_messages(said, "messages", loop, "openai")) == "[ab][cd]"
    assert codec.render_chat(template_messages(said, "messages", loop, "string")) == "[]" * len("ab\ncd")


def test_a_special_token_the_tokenizer_lacks_renders_empty_as_in_transformers(qwen, hf_tokenizer):  # noqa: F811
    """Regression: a template's `{{ bos_token }}` rendered "None" for a tokenizer without one
    (transformers leaves it undefined: ""), found on Gemma 3's template above."""
    template = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}"
    codec = TextCodec(qwen.tokenizer, template, {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": None})
    said = [{"role": "user", "content": "hi"}]
    assert hf_tokenizer.bos_token is None
    assert codec.render_chat(said) == "hi" == hf_tokenizer.apply_chat_template(said, chat_template=template,
                                                                               tokenize=False)
