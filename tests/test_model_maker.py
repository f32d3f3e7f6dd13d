"""`make-model` writes a complete local model (model_maker.py): weights, a tokenizer of its
vocabulary with a chat template, and the manifest last. The tokenizer works through TextCodec
(the Gateway's text routes) and through transformers' AutoTokenizer (what vLLM loads) alike."""
import json
import os

import pytest

from rollout_cluster.engines.checkpoint import MANIFEST, check_checkpoint
from rollout_cluster.model_maker import EOS_ID, check_tokenizer, make_model
from rollout_cluster.text.codec import TextCodec

VOCAB = 512
TEXTS = ["Prove that the sum of two even numbers is even.", "Step 1: compute 1234 + 5678 = 6912!",
         "unicode too: café, naïve, 数学 ✓", "  leading spaces\nand\ttabs  "]
MESSAGES = [{"role": "system", "content": "You solve problems."}, {"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("m") / "tiny"), hidden=32, layers=1, heads=2, vocab=VOCAB,
                      max_positions=256)


def test_the_model_has_a_tokenizer_and_is_sealed_by_its_manifest_last(model):
    files = json.loads((model / MANIFEST).read_text())["files"]
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= set(files)
    check_checkpoint(str(model), require_manifest=True)
    newest = max(os.listdir(model), key=lambda f: os.stat(model / f).st_mtime_ns)
    assert newest == MANIFEST


def test_text_round_trips_through_the_codec_within_the_models_vocabulary(model):
    codec = TextCodec.load(str(model))
    for text in TEXTS:
        ids = codec.encode(text)
        assert ids and max(ids) < VOCAB and codec.decode(ids) == text
    prompt = codec.render_chat(MESSAGES)
    ids = codec.encode(prompt)
    assert prompt.endswith("<|im_start|>assistant\n") and ids.count(1) == 3 and ids.count(EOS_ID) == 2  # one token each
    assert codec.tokenizer.decode(ids, skip_special_tokens=False) == prompt
    # the EOS the engine stops at is the tokenizer's end of turn
    config = json.loads((model / "config.json").read_text())
    assert codec.eos_token_id == config["eos_token_id"] == EOS_ID
    assert codec.encode("<|im_end|>", add_special_tokens=False) == [EOS_ID]


def test_transformers_loads_the_same_tokenizer_and_chat_template(model):
    from transformers import AutoTokenizer

    codec, tok = TextCodec.load(str(model)), AutoTokenizer.from_pretrained(str(model))
    for text in TEXTS:
        assert tok.encode(text) == codec.encode(text)
        assert tok.decode(tok.encode(text)) == text
    assert tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == codec.render_chat(MESSAGES)
    assert tok.eos_token_id == EOS_ID and tok.pad_token == "<|endoftext|>"


def test_making_it_again_keeps_a_complete_model_and_rebuilds_one_without_tokenizer_or_manifest(model):
    weights = (model / "model.safetensors").stat().st_mtime_ns
    make_model(str(model), hidden=32, layers=1, heads=2, vocab=VOCAB, max_positions=256)
    assert (model / "model.safetensors").stat().st_mtime_ns == weights  # complete, same spec: untouched
    for missing in ("tokenizer.json", MANIFEST):
        (model / missing).unlink()
        make_model(str(model), hidden=32, layers=1, heads=2, vocab=VOCAB, max_positions=256)
        assert (model / missing).is_file()
        check_checkpoint(str(model), require_manifest=True)


def test_a_tokenizer_that_does_not_fit_the_config_is_refused(model, tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer.json has \d+ tokens, above the model's vocab_size=300"):
        check_tokenizer(model, 300)
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ("tokenizer.json", "config.json", "generation_config.json"):
        (bad / f).write_bytes((model / f).read_bytes())
    (bad / "config.json").write_text(json.dumps({**json.loads((model / "config.json").read_text()), "eos_token_id": 7}))
    with pytest.raises(ValueError, match=r"config.json: eos_token_id=7, but the tokenizer's <\|im_end\|> is id 2"):
        check_tokenizer(bad, VOCAB)
