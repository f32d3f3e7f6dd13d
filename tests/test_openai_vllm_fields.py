"""Every field of vLLM's own /v1/completions and /v1/chat/completions request models is honoured
as vLLM honours it, ignored for a stated reason (it cannot change the answer), or refused by name:
none is taken and silently ignored (openai_bodies.py). Where it can, a test compares with vLLM's
own code (its tokenize params, its detokenizer)."""
import json
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from rollout_cluster.protocol import Completion
from rollout_cluster.serve.protocols.openai_bodies import ChatBody, CompletionBody
from rollout_cluster.serve.protocols.outputs import output_of
from rollout_cluster.text.codec import TextCodec
from test_gateway_review import _ctx, post
from test_protocols import SCRIPT, TextRouter, app_over, codec, router  # noqa: F401 (fixtures)

vllm_completion = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
vllm_chat = pytest.importorskip("vllm.entrypoints.openai.chat_completion.protocol")
CHAT = {"messages": [{"role": "user", "content": "alpha beta"}], "max_tokens": 2}
LONG = " ".join(SCRIPT.split() * 4)  # 48 words
PAD, START, END = 0, 1, 2  # <|endoftext|>, <|im_start|>, <|im_end|> (make_tokenizer.SPECIALS)


@pytest.fixture(scope="module")
def bos_codec(codec, tmp_path_factory):  # noqa: F811
    """The test tokenizer with a post-processor that writes a BOS (<|endoftext|>, id 0), as Llama's does."""
    tok = Tokenizer.from_str(codec.tokenizer.to_str())
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    return TextCodec(tok, codec.chat_template, codec.special)


@pytest.fixture(scope="module")
def wp_codec():
    """A WordPiece tokenizer: its decoder puts a space between tokens, special ones included."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Whitespace(), decoders.WordPiece()
    tok.train_from_iterator([SCRIPT] * 20, trainer=trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[UNK]", "[CLS]", "[SEP]"], show_progress=False))
    return TextCodec(tok, None, {})


def sent(router, http, path, body, headers=None):  # noqa: F811
    got = http.post(path, content=json.dumps(body), headers={**(headers or {}), "content-type": "application/json",
                                                             "Authorization": "Bearer proto-token-" + "z" * 24})
    assert got.status_code == 200, got.text
    return router.submitted, got


# ---- honoured: the prompt ------------------------------------------------------------------------
def test_add_special_tokens_decides_the_bos_as_in_vllm(router, bos_codec):  # noqa: F811
    http, ids = app_over(router, bos_codec), bos_codec.encode("alpha beta", add_special_tokens=False)
    assert sent(router, http, "/v1/completions", {"prompt": "alpha beta"})[0][0].prompt_token_ids == [0] + ids
    got = sent(router, http, "/v1/completions", {"prompt": "alpha beta", "add_special_tokens": False})[0]
    assert got[0].prompt_token_ids == ids
    chat = sent(router, http, "/v1/chat/completions", CHAT)[0][0].prompt_token_ids  # vLLM's chat default: none
    assert chat[0] == START and sent(router, http, "/v1/chat/completions", {**CHAT, "add_special_tokens": True}
                                     )[0][0].prompt_token_ids == [0] + chat


def vllm_cut(hf, prompt, keep, side, add=True, max_output=16, max_len=4096):
    """vLLM's own cut (renderers/params.py): tokenize with its encode kwargs, then its truncation."""
    from vllm.renderers import TokenizeParams

    params = TokenizeParams(max_total_tokens=max_len, max_output_tokens=max_output, truncate_prompt_tokens=keep,
                            truncation_side=side, add_special_tokens=add)
    ids = hf.encode(prompt, **params.get_encode_kwargs()) if isinstance(prompt, str) else prompt
    return params._token_truncation(hf, ids)


@pytest.mark.parametrize("prompt", [LONG, "alpha beta", list(range(40, 70))])
@pytest.mark.parametrize("keep, side", [(5, None), (5, "left"), (5, "right"), (1, None), (1, "left"), (200, "left")])
@pytest.mark.parametrize("add", [True, False])
def test_truncate_prompt_tokens_cuts_as_vllm_cuts(router, bos_codec, tmp_path, prompt, keep, side, add):  # noqa: F811
    from transformers import PreTrainedTokenizerFast

    bos_codec.tokenizer.save(str(tmp_path / "tokenizer.json"))  # vLLM loads a generative model's with side "left"
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), truncation_side="left")
    body = {"prompt": prompt, "truncate_prompt_tokens": keep, "truncation_side": side, "add_special_tokens": add}
    (req,), _ = sent(router, app_over(router, bos_codec), "/v1/completions", body)
    whole = prompt if isinstance(prompt, list) else bos_codec.encode(prompt, add)
    assert req.prompt_token_ids == vllm_cut(hf, prompt, keep, side, add) and len(req.prompt_token_ids) == min(
        keep, len(whole))
    if isinstance(prompt, str) and add and keep < len(whole):  # the tokenizer's own cut keeps the BOS; "left" not
        assert (req.prompt_token_ids[0] == 0) == (side != "left")


def test_truncate_prompt_tokens_minus_one_is_the_context_less_one_and_more_is_refused(router, codec):  # noqa: F811
    router.status = type(router.status)(lambda: {"model": {"vocab_size": 1000, "max_model_len": 64}})
    http = app_over(router, codec)
    ids = list(range(3, 203))  # longer than the context
    for side in (None, "right"):
        (req,), _ = sent(router, http, "/v1/completions", {"prompt": ids, "truncate_prompt_tokens": -1,
                                                           "truncation_side": side, "max_tokens": 1})
        left = SimpleNamespace(truncation_side="left")  # vLLM's generative tokenizer
        assert req.prompt_token_ids == vllm_cut(left, ids, -1, side, max_output=1, max_len=64)
        assert req.prompt_token_ids == (ids[:63] if side else ids[-63:])
    got = post(http, "/v1/completions", {"prompt": ids, "truncate_prompt_tokens": 65, "max_tokens": 1})
    assert got.status_code == 400 and got.json()["error"]["param"] == "truncate_prompt_tokens", got.text
    assert "65" in got.json()["error"]["message"]
    text = "alpha " * 64 * 101  # more characters than 64 tokens could hold: trimmed, not refused, when cut
    assert post(http, "/v1/completions", {"prompt": text, "max_tokens": 1}).status_code == 400
    (req,), _ = sent(router, http, "/v1/completions", {"prompt": text, "truncate_prompt_tokens": 8, "max_tokens": 1})
    assert req.prompt_token_ids == codec.encode(text)[-8:]
    (req,), _ = sent(router, http, "/v1/chat/completions", {**CHAT, "truncate_prompt_tokens": 3})
    assert req.prompt_token_ids == codec.encode(codec.render_chat(CHAT["messages"]), False)[-3:]


def test_add_generation_prompt_false_renders_without_the_assistant_turn(router, codec):  # noqa: F811
    """Regression: ChatBody declared add_generation_prompt but the template always got True."""
    http = app_over(router, codec)
    (req,), _ = sent(router, http, "/v1/chat/completions", {**CHAT, "add_generation_prompt": False})
    assert req.prompt_token_ids == codec.encode(codec.render_chat(CHAT["messages"], False), False)
    assert codec.decode(req.prompt_token_ids, False).endswith("<|im_end|>\n")


def test_reasoning_effort_and_documents_reach_the_template_as_vllm_merges_them(router, codec):  # noqa: F811
    template = ("{{ messages[0]['content'] }}|{{ reasoning_effort }}|{{ enable_thinking }}|"
                "{{ documents | map(attribute='title') | join(',') if documents else '' }}|{{ add_generation_prompt }}")
    http = app_over(router, TextCodec(codec.tokenizer, template, codec.special))

    def rendered(**fields):
        (req,), _ = sent(router, http, "/v1/chat/completions", {**CHAT, **fields})
        return codec.decode(req.prompt_token_ids)
    assert rendered() == "alpha beta||||True"
    assert rendered(reasoning_effort="low") == "alpha beta|low|True||True"
    kwargs = {"reasoning_effort": "high"}  # the body's reasoning_effort over the kwargs', where set
    assert rendered(chat_template_kwargs=kwargs) == "alpha beta|high|||True"
    assert rendered(reasoning_effort="none", chat_template_kwargs=kwargs) == "alpha beta|none|False||True"
    kwargs = {"enable_thinking": False}  # the kwargs' enable_thinking over the one reasoning_effort implies
    assert rendered(reasoning_effort="low", chat_template_kwargs=kwargs) == "alpha beta|low|False||True"
    assert rendered(documents=[{"title": "d1", "text": "x"}, {"title": "d2", "text": "y"}]) == "alpha beta|||d1,d2|True"
    assert rendered(chat_template_kwargs={"add_generation_prompt": False}) == "alpha beta||||True"  # the body's wins
    assert post(http, "/v1/chat/completions", {**CHAT, "reasoning_effort": "huge"}).status_code == 400


# ---- honoured: the text --------------------------------------------------------------------------
@pytest.mark.parametrize("path, text_of", [("/v1/completions", lambda c: c["text"]),
                                           ("/v1/chat/completions", lambda c: c["message"]["content"])])
def test_skip_special_tokens_false_keeps_their_text_streamed_too(router, codec, path, text_of):  # noqa: F811
    router.script = codec.encode("alpha") + [START, PAD] + codec.encode(" beta")
    http, body = app_over(router, codec), {"prompt": [5], **CHAT, "max_tokens": len(router.script)}
    assert text_of(sent(router, http, path, body)[1].json()["choices"][0]) == "alpha beta"
    kept = sent(router, http, path, {**body, "skip_special_tokens": False})[1].json()["choices"][0]
    assert text_of(kept) == "alpha<|im_start|><|endoftext|> beta"
    stopped = sent(router, http, path, {**body, "skip_special_tokens": False, "stop": ["<|endoftext|>"]})[1]
    assert text_of(stopped.json()["choices"][0]) == "alpha<|im_start|>"
    raw = sent(router, http, path, {**body, "skip_special_tokens": False, "stream": True})[1].text
    assert "<|im_start|><|endoftext|> beta" in raw


def vllm_detokenized(tokenizer, ids, skip, spaces, prompt_ids=()):
    """vLLM's FastIncrementalDetokenizer (what its server decodes with, for a fast tokenizer)."""
    from vllm import SamplingParams
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    detok = FastIncrementalDetokenizer(SimpleNamespace(_tokenizer=tokenizer),
                                       SimpleNamespace(sampling_params=params, prompt_token_ids=list(prompt_ids),
                                                                     request_id="r"))
    return "".join(detok.decode_next(t) for t in ids)


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("spaces", [True, False])
@pytest.mark.parametrize("which", ["wp_codec", "codec"])
def test_special_token_flags_decode_as_vllms_detokenizer(request, which, skip, spaces):
    c = request.getfixturevalue(which)
    specials = [1, 2] if which == "wp_codec" else [END, START]
    a, b = c.encode("alpha beta", add_special_tokens=False)[:2]
    ids = [a, specials[0], specials[1], b, specials[0]]
    out = output_of(_ctx(c), Completion(0, 0, ids, None, "length"), [], False, skip, spaces)
    assert out.text == vllm_detokenized(c.tokenizer, ids, skip, spaces)
    if which == "wp_codec" and not skip:  # the flag matters here: "[CLS] [SEP]" or "[CLS][SEP]"
        assert ("[CLS] [SEP]" in out.text) == spaces


def test_spaces_between_special_tokens_reaches_the_answer(router, wp_codec):  # noqa: F811
    router.script = [wp_codec.tokenizer.token_to_id("alpha"), 1, 2, wp_codec.tokenizer.token_to_id("beta")]
    http, body = app_over(router, wp_codec), {"prompt": [5], "max_tokens": 4, "skip_special_tokens": False}
    # decoded after the prompt, as vLLM's detokenizer does: WordPiece's space before the first token too
    assert sent(router, http, "/v1/completions", body)[1].json()["choices"][0]["text"] == " alpha [CLS] [SEP] beta"
    got = sent(router, http, "/v1/completions", {**body, "spaces_between_special_tokens": False})[1]
    assert got.json()["choices"][0]["text"] == " alpha [CLS][SEP] beta" == vllm_detokenized(
        wp_codec.tokenizer, router.script, False, False, [5])


# ---- honoured: the session and the id -------------------------------------------------------------
def test_session_id_is_the_session_key_in_vllms_order(router, codec):  # noqa: F811
    http, body = app_over(router, codec), {"prompt": [1, 2], "max_tokens": 2, "user": "u"}
    cases = [({"session_id": "s"}, {"X-Session-Id": "h"}, "s"), ({}, {"X-Session-ID": "h"}, "h"),
             ({"vllm_xargs": {"session_id": "x"}}, {}, "x"), ({}, {}, "u")]
    for fields, headers, want in cases:
        assert {r.session for r in sent(router, http, "/v1/completions", {**body, **fields}, headers)[0]} == {want}
    assert {r.session for r in sent(router, http, "/v1/chat/completions", {**CHAT, "session_id": "c"})[0]} == {"c"}


def test_request_id_names_the_answer_as_vllm_does(router, codec):  # noqa: F811
    http = app_over(router, codec)
    assert sent(router, http, "/v1/completions", {"prompt": [1], "request_id": "r1"})[1].json()["id"] == "cmpl-r1"
    got = sent(router, http, "/v1/chat/completions", {**CHAT, "request_id": "r1"}, {"X-Request-Id": "h1"})[1]
    assert got.json()["id"] == "chatcmpl-h1"


def test_a_request_id_is_bounded_as_it_is_echoed_back(router, codec):  # noqa: F811
    http = app_over(router, codec)
    auth = {"content-type": "application/json", "Authorization": "Bearer proto-token-" + "z" * 24}
    long_id = "r" * 257
    got = http.post("/v1/completions", content=json.dumps({"prompt": [1], "request_id": long_id}), headers=auth)
    assert got.status_code == 400 and "request_id" in got.json()["error"]["message"]
    got = http.post("/v1/chat/completions", content=json.dumps(CHAT), headers={**auth, "X-Request-Id": long_id})
    assert got.status_code == 400 and "X-Request-Id: 257 characters" in got.json()["error"]["message"]
    assert not hasattr(router, "submitted")  # nothing was submitted


# ---- refused unless vLLM's default; ignored ones change nothing ----------------------------------
REFUSALS = [("watermarking", True, False), ("priority", 3, 0), ("routed_experts_prompt_start", 4, 0),
            ("kv_transfer_params", {"do_remote_prefill": True}, {}), ("ec_transfer_params", {"a": 1}, None),
            ("repetition_detection", {"max_pattern_size": 4, "min_count": 3}, None),
            ("thinking_token_budget", 100, -1), ("vllm_xargs", {"my_processor": 1}, {"session_id": "s"})]
CHAT_REFUSALS = [("include_reasoning", False, True), ("media_io_kwargs", {"image": {}}, {}),
                 ("mm_processor_kwargs", {"size": 3}, None), ("return_prompt_text", True, False),
                 ("tool_choice", "required", "auto")]


@pytest.mark.parametrize("path, field, bad, default", [("/v1/completions", *r) for r in REFUSALS]
                         + [("/v1/chat/completions", *r) for r in REFUSALS + CHAT_REFUSALS])
def test_a_field_that_cannot_be_honoured_is_refused_by_name_unless_default(
        router, codec, path, field, bad, default):  # noqa: F811
    http, body = app_over(router, codec), {"prompt": [1, 2], **CHAT}
    got = post(http, path, {**body, field: bad})
    assert got.status_code == 400 and got.json()["error"]["param"] == field, got.text
    assert f"{field}={bad!r}" in got.json()["error"]["message"]
    assert post(http, path, {**body, field: default}).status_code == 200


def test_a_priority_header_is_refused_as_the_field_is(router, codec):  # noqa: F811
    http = app_over(router, codec)
    got = http.post("/v1/completions", json={"prompt": [1], "priority": 0}, headers={
        "Authorization": "Bearer proto-token-" + "z" * 24, "X-Vllm-Priority": "-2"})
    assert got.status_code == 400 and got.json()["error"]["param"] == "priority"


IGNORED = {"stream_interval": (4, 0), "length_penalty": (0.5, "long"), "return_token_offsets": (True, 3),
           "mm_payload": ("none", "all"), "return_mm_kwargs": (False, "no"), "parallel_tool_calls": (False, 1)}


@pytest.mark.parametrize("field", sorted(IGNORED))
def test_an_ignored_field_changes_nothing_but_is_type_checked_as_vllm_does(router, codec, field):  # noqa: F811
    http = app_over(router, codec)
    path, body = ("/v1/chat/completions", CHAT) if field == "parallel_tool_calls" else ("/v1/completions",
                                                                                        {"prompt": "alpha"})
    plain = sent(router, http, path, body)
    ok, bad = IGNORED[field]
    same = sent(router, http, path, {**body, field: ok})
    assert same[0][0].prompt_token_ids == plain[0][0].prompt_token_ids and same[0][0].sampling == plain[0][0].sampling
    assert json.loads(same[1].text)["choices"] == json.loads(plain[1].text)["choices"]
    assert post(http, path, {**body, field: bad}).status_code == 400


# ---- the guard: a vLLM upgrade cannot bring back a silent ignore ---------------------------------
UNSET = (None, False, [], {})


@pytest.mark.parametrize("ours, theirs", [(CompletionBody, vllm_completion.CompletionRequest),
                                          (ChatBody, vllm_chat.ChatCompletionRequest)])
def test_every_vllm_field_is_honoured_ignored_or_refused(ours, theirs):
    unknown = [n for n in theirs.model_fields if n not in ours.model_fields and n not in ours.REFUSED]
    assert not unknown, f"vLLM fields neither honoured, ignored with a reason, nor refused: {unknown}"
    assert set(ours.IGNORED) <= set(ours.model_fields) and all(ours.IGNORED.values())
    assert not set(ours.REFUSED) & set(ours.model_fields)  # a declared field never reaches the refusal check
    for name, (accepted, _) in ours.REFUSED.items():  # vLLM's default is never refused
        field = theirs.model_fields.get(name)
        if field is not None and not field.is_required() and field.default_factory is None:
            assert any(field.default == a or (field.default in UNSET and a in UNSET) for a in accepted), name
    for name, field in ours.model_fields.items():  # and a declared field defaults as vLLM's does
        theirs_field = theirs.model_fields.get(name)
        if theirs_field is None or field.is_required() or theirs_field.default_factory is not None:
            continue
        a, b = field.default, theirs_field.default
        assert a == b or (a in UNSET and b in UNSET), f"{name}: ours {a!r}, vLLM's {b!r}"
