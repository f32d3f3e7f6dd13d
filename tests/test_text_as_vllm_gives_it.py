"""Text as vLLM 0.32's server gives it (or transformers' apply_chat_template, which it calls), for
the same request: each test compares with vLLM's own detokenizer or transformers where installed.

1. Stop strings: when several complete in the same token, the one that completes earliest in the
   text wins, ties broken by the request's stop-list order (vLLM's check_stop_strings).
2. Stop strings and `min_tokens`: no stop string ends a sample within its first `min_tokens`
   tokens' text (vLLM's BaseIncrementalDetokenizer.update, vLLM PR 22014).
3. Chat templates render in transformers' Jinja environment (text/chat_jinja.py): the
   `{% generation %}` block (TRL's *_training templates, LFM2.5's own), the `strftime_now` global
   (gpt-oss's template calls it unguarded) and `tojson`'s keyword arguments (GLM-4.5's template).
"""
import copy
import json
from datetime import datetime
from types import SimpleNamespace

import pytest

from rollout_cluster.protocol import Completion
from rollout_cluster.serve.protocols.outputs import output_of
from rollout_cluster.text.codec import TextCodec
from rollout_cluster.text.make_tokenizer import make_tokenizer
from test_gateway_review import _ctx, post
from test_protocols import SCRIPT, TextRouter, app_over, codec  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    """The demo model's tokenizer (models/tiny-llama's: make_tokenizer's defaults), made here."""
    folder = tmp_path_factory.mktemp("tiny")
    make_tokenizer(str(folder))
    return str(folder)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return TextCodec.load(tiny_dir)


def vllm_cut(codec, prompt, ids, stops, include=False, min_tokens=0):
    """(token ids, text, stop string) as vLLM 0.32's detokenizer gives them, a token a step."""
    from vllm import SamplingParams
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    detok = FastIncrementalDetokenizer(SimpleNamespace(_tokenizer=codec.tokenizer), SimpleNamespace(
        sampling_params=SamplingParams(stop=stops, include_stop_str_in_output=include, min_tokens=min_tokens),
        prompt_token_ids=list(prompt), request_id="r"))
    for k, t in enumerate(ids):
        hit = detok.update([t], False)
        if hit is not None:
            return ids[:k + 1], detok.get_next_output_text(True, False), hit
    return ids, detok.output_text, None


# ---- 1. which stop string wins when several complete in one token ------------------------------------
# " the answer is 42." tokenizes (models/tiny-llama) as " the", " answer", " is", " 42", "."
STOP_CASES = [
    # (stops, include, want text, want stop_reason); the ids are cut after the token completing it
    # " 4" completes in " 42" before "is 42" does: the text is cut before " 4"
    (["is 42", " 4"], False, " the answer is", " 4"),
    (["is 42", " 4"], True, " the answer is 4", " 4"),
    # "sw" completes inside " answer" before "answer" does
    (["answer", "sw"], False, " the an", "sw"),
    # both complete at the same character: the request's first one wins
    (["wer", "answer"], False, " the ans", "wer"),
]


@pytest.mark.parametrize("stops, include, want_text, want_stop", STOP_CASES)
def test_the_stop_string_completed_first_in_the_text_wins_as_in_vllm(tiny, stops, include, want_text, want_stop):
    prompt = tiny.encode("Solve the question")
    ids = tiny.encode(" the answer is 42. Then compute the sum", add_special_tokens=False)
    out = output_of(_ctx(tiny), Completion(0, 0, ids, None, "length"), stops, include, prompt_ids=prompt)
    assert (out.text, out.stop_reason, out.finish_reason) == (want_text, want_stop, "stop")
    kept = " the answer is 42" if want_stop == " 4" else " the answer"
    assert out.token_ids == ids[:len(tiny.encode(kept, add_special_tokens=False))]


@pytest.mark.parametrize("stops, include, want_text, want_stop", STOP_CASES)
def test_stop_string_choice_matches_vllms_detokenizer(tiny, stops, include, want_text, want_stop):
    pytest.importorskip("vllm.v1.engine.detokenizer")
    prompt = tiny.encode("Solve the question")
    ids = tiny.encode(" the answer is 42. Then compute the sum", add_special_tokens=False)
    out = output_of(_ctx(tiny), Completion(0, 0, ids, None, "length"), stops, include, prompt_ids=prompt)
    assert (out.token_ids, out.text, out.stop_reason) == vllm_cut(tiny, prompt, ids, stops, include)


# ---- 2. min_tokens: no stop string in the first min_tokens tokens ------------------------------------
def test_a_stop_string_inside_the_first_min_tokens_does_not_end_the_sample(codec):  # noqa: F811
    """SCRIPT starts "alpha beta gamma ..." ("a", "lp", "h", "a", " be", ...): "lph" completes in the
    3rd token, within min_tokens=4. vLLM
    keeps going (it searches stop strings only in the text of tokens past min_tokens); here the
    answer was cut after 3 tokens with finish_reason "stop", fewer tokens than min_tokens asked for."""
    router = TextRouter(codec)
    http = app_over(router, codec)
    prompt = [5, 6, 7]
    got = post(http, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "min_tokens": 4, "stop": ["lph"],
                                         "return_token_ids": True})
    assert got.status_code == 200, got.text
    choice = got.json()["choices"][0]
    ids = codec.encode(SCRIPT)[:6]
    assert "lph" in codec.decode(ids[:4], prompt_ids=prompt)  # (the stop string is inside min_tokens)
    assert (choice["finish_reason"], choice["stop_reason"]) == ("length", None), choice
    assert choice["token_ids"] == ids and choice["text"] == codec.decode(ids, prompt_ids=prompt)


def test_min_tokens_stop_strings_match_vllms_detokenizer(codec):  # noqa: F811
    pytest.importorskip("vllm.v1.engine.detokenizer")
    router = TextRouter(codec)
    http = app_over(router, codec)
    prompt = [5, 6, 7]
    # "lph" inside the first 4 tokens is skipped; "gam" (10th token) ends it
    got = post(http, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "min_tokens": 4,
                                         "stop": ["lph", "gam"], "return_token_ids": True})
    assert got.status_code == 200, got.text
    choice = got.json()["choices"][0]
    ids, text, stop = vllm_cut(codec, prompt, codec.encode(SCRIPT)[:12], ["lph", "gam"], min_tokens=4)
    assert (choice["token_ids"], choice["text"], choice["stop_reason"]) == (ids, text, stop)
    assert stop == "gam" and len(ids) == 10


# ---- 3. chat templates that transformers (and so vLLM's server) renders ------------------------------
def _with_template(codec: TextCodec, template: str) -> TextCodec:
    other = copy.copy(codec)
    other.chat_template, other._compiled = template, {}
    return other


def _transformers(folder: str, template: str, messages, **kwargs) -> str:
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
    return hf.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True,
                                  **kwargs)


# TRL's *_training templates (and LFM2.5's shipped one) mark the assistant's text with a
# {% generation %} block for assistant-only loss; transformers renders it as its body
GENERATION = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
              "{{ m.content }}<|im_end|>{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# gpt-oss's template: "Current date: " + strftime_now("%Y-%m-%d"), not guarded
STRFTIME = ("<|start|>system<|message|>Current date: {{ strftime_now('%Y-%m-%d') }}<|end|>"
            "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
# GLM-4.5's template: tools and tool arguments through tojson(ensure_ascii=False)
TOJSON_KWARGS = ("{% if tools %}{% for t in tools %}{{ t | tojson(ensure_ascii=False) }}\n{% endfor %}{% endif %}"
                 "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
MESSAGES = [{"role": "user", "content": "Weather in Zürich?"}, {"role": "assistant", "content": "Sunny."},
            {"role": "user", "content": "Tomorrow?"}]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Météo.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_a_template_with_a_generation_block_renders_as_transformers_renders_it(tiny, tiny_dir):
    got = _with_template(tiny, GENERATION).render_chat(copy.deepcopy(MESSAGES))
    assert got == _transformers(tiny_dir, GENERATION, MESSAGES)


def test_a_template_that_calls_strftime_now_renders_todays_date(tiny, tiny_dir):
    today = datetime.now().strftime("%Y-%m-%d")
    got = _with_template(tiny, STRFTIME).render_chat(copy.deepcopy(MESSAGES))
    assert f"Current date: {today}<|end|>" in got
    assert got == _transformers(tiny_dir, STRFTIME, MESSAGES)


def test_a_template_that_passes_tojson_keyword_arguments_renders(tiny, tiny_dir):
    got = _with_template(tiny, TOJSON_KWARGS).render_chat(copy.deepcopy(MESSAGES), tools=copy.deepcopy(TOOLS))
    assert got.startswith(json.dumps(TOOLS[0], ensure_ascii=False) + "\n")
    assert got == _transformers(tiny_dir, TOJSON_KWARGS, MESSAGES, tools=TOOLS)


def test_the_chat_route_answers_a_model_whose_template_has_a_generation_block(tiny, tiny_dir):
    """Through /v1/chat/completions: every chat request to such a model was a 400 ("the chat
    template refused it: Encountered unknown tag 'generation'")."""
    model = _with_template(tiny, GENERATION)
    http = app_over(TextRouter(model), model)
    got = post(http, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "return_token_ids": True})
    assert got.status_code == 200, got.text
    want = _transformers(tiny_dir, GENERATION, MESSAGES)
    assert got.json()["prompt_token_ids"] == model.encode(want, add_special_tokens=False)
