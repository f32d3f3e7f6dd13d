"""A small byte-level BPE tokenizer for the local random-weight model, trained with the
`tokenizers` library on generated text, saved as a Hugging Face fast tokenizer: tokenizer.json,
and tokenizer_config.json with a ChatML chat template (the layout Qwen's models use). Every
string encodes (byte level), and its vocabulary matches the model's, so text prompts, chat and
detokenized `text` work on the demo model as on a real one."""
from __future__ import annotations

import json
import random
from pathlib import Path

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
WORDS = ("the a of to and in is it you that he was for on are with as his they be at one have this from or had by "
         "word but what some we can out other were all there when up use your how said an each she which do their "
         "time if will way about many then them write would like so these her long make thing see him two has look "
         "more day could go come did number sound no most people my over know water than call first who may down "
         "side been now find any new work part take get place made live where after back little only round man year "
         "came show every good me give our under name very through just form sentence great think say help low line "
         "reward policy gradient rollout token sample answer question prove compute solve step number sum").split()


def corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    """Generated sentences: English words, digits, punctuation and some chat markup."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        out.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ":", ","]))
    return out


def make_tokenizer(out_dir: str, vocab_size: int = 2048, max_len: int = 4096) -> Path:
    """Train and save the tokenizer in `out_dir`; its ids are all < vocab_size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    if tok.get_vocab_size() > vocab_size:
        raise ValueError(f"the tokenizer has {tok.get_vocab_size()} tokens, the model {vocab_size}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len, "chat_template": CHAT_TEMPLATE,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
        "clean_up_tokenization_spaces": False, "added_tokens_decoder": {
            str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False, "normalized": False,
                     "single_word": False} for i, t in enumerate(SPECIALS)}}, indent=1))
    return out
