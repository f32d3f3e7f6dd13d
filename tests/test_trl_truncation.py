"""TRL 0.25-0.29's `truncate_prompt_tokens` on /generate/ and /chat/ (their VLLMClient sends it,
GRPOTrainer with its max_prompt_length): `trl vllm-serve` put it in vLLM's SamplingParams, and
vLLM 0.10.2-0.12 (the versions those TRLs take) cut as their LLM class did: _validate_truncation_size
(-1 is max_model_len; more is refused), a text through the Hugging Face tokenizer with
truncation=True, max_length=k (loaded with truncation_side="left": the last tokens, a BOS kept),
token ids and a rendered chat (TokensPrompt) sliced by InputPreprocessor._truncate_inputs
(ids[-k:]); SamplingParams refuses 0 and below -1. Regression: the routes refused the field, so
such a trainer failed on its first generation."""
import json

import pytest

from rollout_cluster.protocol import ModelInfo
from test_openai_vllm_fields import LONG, bos_codec  # noqa: F401 (fixture: a tokenizer that writes a BOS)
from test_protocols import AUTH, app_over, codec, router  # noqa: F401 (fixtures)

CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": LONG}]


def trl_body(route: str, prompts, truncate_prompt_tokens, max_tokens: int = 2) -> dict:
    """The body TRL 0.29.1's VLLMClient.generate (or .chat) posts, its defaults and all."""
    body = {"n": 1, "repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0,
            "max_tokens": max_tokens, "logprobs": 0, "truncate_prompt_tokens": truncate_prompt_tokens,
            "structured_outputs_regex": None, "generation_kwargs": {}}
    if route == "/generate/":
        return {"prompts": prompts, "images": None, **body}
    return {"messages": prompts, **body, "chat_template_kwargs": {}}


def vllm012_cut(hf, prompt, keep, chat=False) -> list:
    """vLLM 0.12's LLM: the tokenizer's cut of a text, or _truncate_inputs of ids (a chat is
    rendered and encoded without special tokens, then sliced)."""
    if isinstance(prompt, str) and not chat:
        return hf.encode(prompt, truncation=keep is not None, max_length=keep)
    ids = hf.encode(prompt, add_special_tokens=False) if chat else prompt
    return ids if keep is None else ids[-keep:]


@pytest.fixture
def hf(bos_codec, tmp_path):  # noqa: F811
    from transformers import PreTrainedTokenizerFast

    bos_codec.tokenizer.save(str(tmp_path / "tokenizer.json"))  # vLLM loads a generative model's with side "left"
    return PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), truncation_side="left")


def _context(router, max_model_len: int) -> None:
    router.status = type(router.status)(lambda: {"model": ModelInfo(1000, max_model_len).__dict__})


def _answer(http, path, body) -> dict:
    got = http.post(path, content=json.dumps(body), headers={**AUTH, "content-type": "application/json"})
    assert got.status_code == 200, got.text
    return got.json()


PROMPTS = {"text": [LONG, "alpha beta"], "ids": [list(range(40, 140)), [7, 8, 9]]}
CONVERSATIONS = [CONVERSATION, CONVERSATION[1:], [{"role": "user", "content": "hi"}]]


@pytest.mark.parametrize("keep", [None, 1, 2, 5, 40, 300])
@pytest.mark.parametrize("kind", sorted(PROMPTS))
def test_generate_cuts_text_and_ids_as_trl_029_on_vllm_012(router, bos_codec, hf, keep, kind):  # noqa: F811
    _context(router, 512)
    body = _answer(app_over(router, bos_codec), "/generate/", trl_body("/generate/", PROMPTS[kind], keep))
    want = [vllm012_cut(hf, p, keep) for p in PROMPTS[kind]]
    assert body["prompt_ids"] == want and [r.prompt_token_ids for r in router.submitted] == want
    if kind == "text" and keep is not None and keep < len(bos_codec.encode(LONG)):
        assert want[0][0] == 0 and len(want[0]) == keep  # the tokenizer's own cut keeps the BOS


@pytest.mark.parametrize("keep", [None, 1, 3, 17, 300])
def test_chat_cuts_the_rendered_prompt_as_trl_029_on_vllm_012(router, bos_codec, hf, keep):  # noqa: F811
    _context(router, 512)
    body = _answer(app_over(router, bos_codec), "/chat/", trl_body("/chat/", CONVERSATIONS, keep))
    want = [vllm012_cut(hf, bos_codec.render_chat(c), keep, chat=True) for c in CONVERSATIONS]
    assert body["prompt_ids"] == want and [r.prompt_token_ids for r in router.submitted] == want


def test_minus_one_keeps_the_context_less_a_token_for_the_output(router, bos_codec, hf):  # noqa: F811
    """vLLM 0.12 cut to the whole context (64) and sampled a single token; the engines here refuse a
    prompt that fills the context, so -1 keeps 63, as /v1's -1 does. A prompt and max_tokens must
    still fit the context together, as anywhere here: more is refused naming max_tokens."""
    _context(router, 64)
    http = app_over(router, bos_codec)
    for prompts in PROMPTS.values():
        body = _answer(http, "/generate/", trl_body("/generate/", prompts, -1, max_tokens=1))
        assert body["prompt_ids"] == [vllm012_cut(hf, p, 63) for p in prompts]
    body = _answer(http, "/chat/", trl_body("/chat/", CONVERSATIONS, -1, max_tokens=1))
    assert body["prompt_ids"] == [vllm012_cut(hf, bos_codec.render_chat(c), 63, chat=True) for c in CONVERSATIONS]
    assert len(body["prompt_ids"][0]) == 63
    got = http.post("/generate/", json=trl_body("/generate/", PROMPTS["ids"], -1, max_tokens=2), headers=AUTH)
    assert got.status_code == 422 and got.json()["detail"][0]["loc"] == ["body", "max_tokens"], got.text


@pytest.mark.parametrize("route", ["/generate/", "/chat/"])
@pytest.mark.parametrize("keep", [0, -2, 65, "8", 2.0, True])
def test_a_bad_truncate_prompt_tokens_is_refused_naming_it(router, codec, route, keep):  # noqa: F811
    """0 and below -1: vLLM 0.12's SamplingParams refuses them; above the context:
    _validate_truncation_size; not an integer: TRL's request model (strict here, as every field)."""
    _context(router, 64)
    prompts = [[1, 2, 3]] if route == "/generate/" else [CONVERSATION]
    got = app_over(router, codec).post(route, json=trl_body(route, prompts, keep), headers=AUTH)
    assert got.status_code == 422 and got.json()["detail"][0]["loc"] == ["body", "truncate_prompt_tokens"], got.text
