"""An output's text is decoded as the prompt's continuation, as vLLM's detokenizer decodes it
(FastIncrementalDetokenizer primes its DecodeStream with the prompt's ids).

Regression: the protocols decoded the output's ids alone. With a SentencePiece-style tokenizer
(Metaspace: Llama-2, Mistral) the first token's space was dropped ("world again" where vLLM says
" world again"), and a WordPiece decoder's space before the first token too; stop strings were
searched in that text, so a stop string with a leading space could be missed. Byte-level
tokenizers (Qwen, Llama-3, GPT-2) were not affected. Each check here compares with vLLM's own
detokenizer, on random prompts and outputs (Hypothesis)."""
import json
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from rollout_cluster.protocol import Completion
from rollout_cluster.serve.protocols.outputs import output_of
from rollout_cluster.text.codec import TextCodec
from test_gateway_review import _ctx
from test_openai_vllm_fields import wp_codec  # noqa: F401 (fixture: a WordPiece tokenizer)
from test_protocols import SCRIPT, TextRouter, app_over, codec  # noqa: F401 (fixtures)

pytest.importorskip("vllm.v1.engine.detokenizer")
TEXT = SCRIPT + " Hello world again, said the über-model: naïve café 42!"


@pytest.fixture(scope="module")
def metaspace_codec():
    """A SentencePiece-style tokenizer (Llama-2's, Mistral's): spaces are "▁" in the tokens, and the
    decoder drops the space of the text's first token."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator([TEXT] * 20, trainer=trainers.BpeTrainer(
        vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    return TextCodec(tok, None, {})


def vllm_text(tokenizer, prompt_ids, ids, skip=True):
    """What vLLM's detokenizer gives for `ids` after `prompt_ids` (its server's `text`)."""
    from vllm import SamplingParams
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer

    detok = FastIncrementalDetokenizer(SimpleNamespace(_tokenizer=tokenizer), SimpleNamespace(
        sampling_params=SamplingParams(skip_special_tokens=skip), prompt_token_ids=list(prompt_ids), request_id="r"))
    return "".join(detok.decode_next(t) for t in ids)


def test_a_sentencepiece_output_keeps_its_first_space_as_vllm_does(metaspace_codec):
    prompt = metaspace_codec.encode("Hello")
    ids = metaspace_codec.encode("world again", add_special_tokens=False)
    out = output_of(_ctx(metaspace_codec), Completion(0, 0, ids, None, "length"), [], prompt_ids=prompt)
    assert out.text == vllm_text(metaspace_codec.tokenizer, prompt, ids) == " world again"


def test_a_stop_string_with_its_leading_space_is_found_after_the_prompt(metaspace_codec):
    prompt = metaspace_codec.encode("Hello")
    ids = metaspace_codec.encode("world again", add_special_tokens=False)
    out = output_of(_ctx(metaspace_codec), Completion(0, 0, ids, None, "length"), [" world"], prompt_ids=prompt)
    assert (out.text, out.finish_reason, out.stop_reason) == ("", "stop", " world")


def test_the_answer_of_a_completion_route_is_decoded_after_its_prompt(metaspace_codec):
    router = TextRouter(metaspace_codec)
    router.script = metaspace_codec.encode("world again", add_special_tokens=False)
    http = app_over(router, metaspace_codec)
    prompt = metaspace_codec.encode("Hello")
    got = http.post("/v1/completions", content=json.dumps({"prompt": prompt, "max_tokens": len(router.script)}),
                    headers={"content-type": "application/json", "Authorization": "Bearer proto-token-" + "z" * 24})
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["text"] == " world again"


def test_a_prompt_whose_last_tokens_decode_to_nothing_is_decoded_after_the_text_before_them(wp_codec):  # noqa: F811
    """Regression (found by the test below): decode() put only the prompt's last 8 tokens before the
    output; where those decode to nothing (skipped special tokens, ids the vocabulary lacks), the
    WordPiece decoder's space before the output's first token was lost: vLLM primes with the whole
    prompt."""
    cls = wp_codec.tokenizer.token_to_id("[CLS]")
    first, second = SCRIPT.split()[:2]  # (words its vocabulary has)
    word, out = (wp_codec.encode(w, add_special_tokens=False) for w in (first, second))
    for prompt, skip in ((word + [cls] * 9, True), ([0] + [wp_codec.tokenizer.get_vocab_size() + 5] * 8, False)):
        want = vllm_text(wp_codec.tokenizer, prompt, out, skip)
        assert want.startswith(" ") and wp_codec.decode(out, skip, prompt) == want


ids_of = st.lists(st.integers(0, 119), min_size=0, max_size=12)


@pytest.mark.parametrize("which", ["metaspace_codec", "wp_codec", "codec"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=ids_of, ids=st.lists(st.integers(0, 119), min_size=1, max_size=24), skip=st.booleans(),
       stops=st.lists(st.text(alphabet=" abelorwdñ▁", min_size=1, max_size=3), max_size=2))
def test_text_and_stop_cuts_equal_vllms_detokenizer(request, which, prompt, ids, skip, stops):
    c = request.getfixturevalue(which)
    out = output_of(_ctx(c), Completion(0, 0, ids, None, "length"), [], skip_special_tokens=skip, prompt_ids=prompt)
    assert out.text == vllm_text(c.tokenizer, prompt, ids, skip)
    cut = output_of(_ctx(c), Completion(0, 0, ids, None, "length"), stops, skip_special_tokens=skip, prompt_ids=prompt)
    full = out.text
    hits = [(full.find(s) + len(s), s) for s in stops if s in full]
    if hits:  # vLLM stops at the token that completes the first stop string: the text before it
        end, s = min(hits)
        assert cut.finish_reason == "stop" and cut.text == full[:full.find(cut.stop_reason)]
        assert vllm_text(c.tokenizer, prompt, cut.token_ids, skip).find(cut.stop_reason) >= 0
    else:
        assert cut.text == full and cut.token_ids == ids


@pytest.mark.parametrize("which", ["metaspace_codec", "wp_codec", "codec"])
def test_logprob_token_texts_are_named_as_vllm_names_them(request, which):
    """Regression: a SentencePiece token's text in logprobs lost its leading space ("world" where
    vLLM's logprobs say " world"): decoding one token alone drops it, and vLLM puts it back."""
    from transformers import PreTrainedTokenizerFast
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

    c = request.getfixturevalue(which)
    ids = list(range(min(c.tokenizer.get_vocab_size(), 300)))
    theirs = convert_ids_list_to_tokens(PreTrainedTokenizerFast(tokenizer_object=c.tokenizer), ids)
    assert c.token_texts(ids) == theirs
    if which == "metaspace_codec":
        assert c.token_texts(c.encode("Hello world", add_special_tokens=False))[-1].startswith(" ")
