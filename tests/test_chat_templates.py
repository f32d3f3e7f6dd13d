"""A model's several named chat templates, picked as transformers 5 picks them (get_chat_template,
which vLLM's server calls): the request's `chat_template` name, else "tool_use" when tools are
passed (an empty list too), else "default"; found where transformers finds them (tokenizer_config's
`chat_template` list, chat_template.jinja and additional_chat_templates/). Each choice is compared
with transformers' own apply_chat_template over the same folder (no model hub: the tokenizer is
made here). A name the model has no template by is a 400 naming `chat_template` and the value."""
import json

import pytest

from rollout_cluster.text.codec import NoSuchTemplate, TextCodec
from rollout_cluster.text.make_tokenizer import make_tokenizer
from test_gateway_review import post
from test_protocols import TextRouter, app_over

transformers = pytest.importorskip("transformers")

DEFAULT = "D:{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}{% if add_generation_prompt %}>{% endif %}"
TOOL_USE = ("T:{% for t in tools or [] %}{{ t.function.name }},{% endfor %}|{% for m in messages %}{{ m.content }};"
            "{% endfor %}")
OTHER = "O:{{ messages | length }}"
MESSAGES = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}}]


def folder_with(tmp_path, config_templates=None, files=None) -> str:
    """A model folder (tokenizer made here) whose tokenizer_config's chat_template is
    `config_templates` and whose template files are `files` ({"chat_template.jinja": ...,
    "additional_chat_templates/tool_use.jinja": ...})."""
    folder = tmp_path / "tok"
    make_tokenizer(str(folder), vocab_size=400)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = config_templates
    if config_templates is None:
        del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in (files or {}).items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(text)
    return str(folder)


def transformers_text(folder: str, name=None, tools=None) -> str:
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    return hf.apply_chat_template(MESSAGES, tools=tools, chat_template=name, tokenize=False, add_generation_prompt=True)


NAMED_LIST = [{"name": "default", "template": DEFAULT}, {"name": "tool_use", "template": TOOL_USE},
              {"name": "other", "template": OTHER}]
LAYOUTS = {
    "tokenizer_config list": {"config_templates": NAMED_LIST},
    "template files": {"config_templates": "ignored: the files win",
                       "files": {"chat_template.jinja": DEFAULT, "additional_chat_templates/tool_use.jinja": TOOL_USE,
                                 "additional_chat_templates/other.jinja": OTHER}},
}
PICKS = [  # (chat_template, tools) -> the template transformers renders
    (None, None, DEFAULT), (None, TOOLS, TOOL_USE), (None, [], TOOL_USE), ("default", TOOLS, DEFAULT),
    ("tool_use", None, TOOL_USE), ("other", TOOLS, OTHER)]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name, tools, picked", PICKS)
def test_the_template_is_picked_as_transformers_picks_it(tmp_path, layout, name, tools, picked):
    folder = folder_with(tmp_path, **LAYOUTS[layout])
    codec = TextCodec.load(folder)
    assert codec.template_source(name, tools is not None) == picked
    text = codec.render_chat(MESSAGES, True, name, **({} if tools is None else {"tools": tools}))
    assert text == transformers_text(folder, name, tools)
    # and through the route: the prompt the engines get is that text's tokens
    router = TextRouter(codec)
    body = {"messages": MESSAGES, "max_tokens": 2, **({} if name is None else {"chat_template": name}),
            **({} if tools is None else {"tools": tools})}
    got = post(app_over(router, codec), "/v1/chat/completions", body)
    assert got.status_code == 200, got.text
    assert router.submitted[0].prompt_token_ids == codec.encode(text, add_special_tokens=False)


def test_the_trl_chat_route_picks_tool_use_with_tools(tmp_path):
    folder = folder_with(tmp_path, **LAYOUTS["tokenizer_config list"])
    codec = TextCodec.load(folder)
    router = TextRouter(codec)
    got = post(app_over(router, codec), "/chat/", {"messages": [MESSAGES], "max_tokens": 2, "tools": TOOLS})
    assert got.status_code == 200, got.text
    text = transformers_text(folder, None, TOOLS)
    assert text.startswith("T:add,") and router.submitted[0].prompt_token_ids == codec.encode(text, False)


# ---- a tokenizer_config list of named templates: only "default" was ever rendered; tools and a
# ---- request's chat_template name were not honoured, and the name was refused as a template's text
@pytest.mark.parametrize("value", ["tool_use ", "Default", "{{ messages }}", "x" * 200])
def test_a_name_the_model_has_no_template_by_is_refused_naming_field_and_value(tmp_path, value):
    codec = TextCodec.load(folder_with(tmp_path, NAMED_LIST))
    got = post(app_over(TextRouter(codec), codec), "/v1/chat/completions",
               {"messages": MESSAGES, "max_tokens": 2, "chat_template": value})
    error = got.json()["error"]
    assert got.status_code == 400 and error["param"] == "chat_template", got.text
    assert repr(value)[:60] in error["message"] and "default, other, tool_use" in error["message"]


def test_several_templates_without_a_default_need_a_name(tmp_path):
    folder = folder_with(tmp_path, [t for t in NAMED_LIST if t["name"] != "default"])
    with pytest.raises(ValueError, match="no default specified"):  # transformers' refusal
        transformers_text(folder)
    codec = TextCodec.load(folder)
    with pytest.raises(NoSuchTemplate):
        codec.template_source()
    got = post(app_over(TextRouter(codec), codec), "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    assert got.status_code == 400 and got.json()["error"]["param"] == "chat_template", got.text
    assert "other, tool_use" in got.json()["error"]["message"]
    assert codec.render_chat(MESSAGES, True, tools=TOOLS) == transformers_text(folder, None, TOOLS)  # tool_use


def test_a_models_one_template_is_named_default(tmp_path):
    folder = folder_with(tmp_path, files={"chat_template.jinja": DEFAULT})
    codec = TextCodec.load(folder)
    assert codec.chat_template == DEFAULT  # one template: the string, as transformers holds it
    assert codec.render_chat(MESSAGES, True, "default") == codec.render_chat(MESSAGES) == transformers_text(folder)
    got = post(app_over(TextRouter(codec), codec), "/v1/chat/completions",
               {"messages": MESSAGES, "max_tokens": 2, "chat_template": "tool_use"})
    assert got.status_code == 400 and got.json()["error"]["param"] == "chat_template", got.text


@pytest.mark.parametrize("key", ["chat_template", "tokenize"])
def test_chat_template_kwargs_cannot_name_the_template(tmp_path, key):
    """vLLM refuses them in chat_template_kwargs (resolve_chat_template_kwargs): the template is
    named by the body's chat_template."""
    codec = TextCodec.load(folder_with(tmp_path, NAMED_LIST))
    got = post(app_over(TextRouter(codec), codec), "/v1/chat/completions",
               {"messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {key: "tool_use"}})
    assert got.status_code == 400 and got.json()["error"]["param"] == f"chat_template_kwargs.{key}", got.text


def test_tools_and_documents_are_none_when_not_given_as_transformers_renders_them(tmp_path):
    """A template that tells an absent `tools` from None (`tools is none`) renders as transformers'."""
    probe = "{{ tools is defined }}/{{ tools is none }}/{{ documents is none }}/{{ tools | length if tools else 0 }}"
    folder = folder_with(tmp_path, probe)
    codec = TextCodec.load(folder)
    for tools in (None, [], TOOLS):
        kwargs = {} if tools is None else {"tools": tools}
        assert codec.render_chat(MESSAGES, True, **kwargs) == transformers_text(folder, None, tools)
