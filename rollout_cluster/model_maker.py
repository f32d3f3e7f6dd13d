"""`rollout-cluster make-model DIR`: a small Llama with random weights, saved like any HF model.

No model hub is reachable here, so tests and the demo load a model made locally through the
real loading path: config.json + safetensors, a byte-level BPE tokenizer of the model's vocabulary
(text/make_tokenizer.py: tokenizer.json, tokenizer_config.json with a ChatML chat template), and
rollout-manifest.json written last (engines/checkpoint.py), as a trainer seals a checkpoint.

Special tokens, as Qwen2.5-Instruct has them: <|endoftext|> (id 0) is the BOS of config.json
and generation_config.json and the pad token; <|im_end|> (id 2), which ends every chat turn, is
the EOS: a chat reply stops at the end of its turn. <|im_start|> is id 1.
"""
from __future__ import annotations

import json
from pathlib import Path

from .engines.checkpoint import MANIFEST, CheckpointError, check_checkpoint, write_manifest

SPEC_FORMAT = 2  # what make_model writes (2: with a tokenizer and the manifest); a folder of another is made again
BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
BOS_ID, EOS_ID = 0, 2  # their ids in the tokenizer (text/make_tokenizer.py SPECIALS)


def make_model(out_dir: str, hidden: int = 128, layers: int = 2, heads: int = 2, vocab: int = 2048,
               intermediate: int | None = None, max_positions: int = 4096, seed: int = 0,
               dtype: str = "float32") -> Path:
    out = Path(out_dir)
    spec = _spec(hidden, layers, heads, vocab, intermediate, max_positions, seed, dtype)
    if _made(out, spec):
        return out  # already made with the same spec, and complete
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from .text.make_tokenizer import make_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # unsealed while it is written again
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate or 2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab,
                      max_position_embeddings=max_positions, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                      tie_word_embeddings=False, torch_dtype=dtype)
    model = LlamaForCausalLM(cfg)
    # Random init gives near-uniform next-token distributions; scale up the head so greedy
    # decoding has clear winners and sampling is not pure noise.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model = model.to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    make_tokenizer(str(out), vocab_size=vocab, max_len=max_positions)
    check_tokenizer(out, vocab)
    (out / "rollout_model.json").write_text(json.dumps(spec))
    write_manifest(str(out))  # last: the folder is complete
    return out


def check_tokenizer(out: Path, vocab: int) -> None:
    """The tokenizer fits the model: every id below its vocab_size, and the BOS and EOS ids of
    config.json and generation_config.json are the tokenizer's <|endoftext|> and <|im_end|>."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    if tok.get_vocab_size() > vocab:
        raise ValueError(f"tokenizer.json has {tok.get_vocab_size()} tokens, above the model's vocab_size={vocab}")
    ids = {"bos_token_id": tok.token_to_id(BOS_TOKEN), "eos_token_id": tok.token_to_id(EOS_TOKEN)}
    for name in ("config.json", "generation_config.json"):
        written = json.loads((out / name).read_text())
        for key, want in ids.items():
            if written.get(key) != want:
                raise ValueError(f"{name}: {key}={written.get(key)!r}, but the tokenizer's "
                                 f"{BOS_TOKEN if key == 'bos_token_id' else EOS_TOKEN} is id {want}")


def _made(out: Path, spec: dict) -> bool:
    """`out` holds a complete model of this spec: its spec file, tokenizer, and a manifest that checks."""
    try:
        if json.loads((out / "rollout_model.json").read_text()) != spec or not (out / "tokenizer.json").is_file():
            return False
        check_checkpoint(str(out), require_manifest=True, verify_sha256=False)
    except (OSError, ValueError, CheckpointError):
        return False
    return True


# Public architecture configs (config.json of the Qwen2.5 releases), for dummy-weight engines:
# vLLM builds the model from the config and fills it with random weights (load_format="dummy").
ARCHITECTURES = {
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}


def write_arch_config(out_dir: str, arch: str) -> Path:
    """A config.json (no weights) of a public architecture, for `load_format: dummy`."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch={arch!r}: known architectures are {', '.join(ARCHITECTURES)}")
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
           "max_position_embeddings": 32768, "max_window_layers": 28, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
           "sliding_window": 131072, "use_sliding_window": False, "use_cache": True, "torch_dtype": "bfloat16",
           "bos_token_id": 151643, "eos_token_id": 151645, "attention_dropout": 0.0, "initializer_range": 0.02,
           **ARCHITECTURES[arch]}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 151643, "eos_token_id": 151645}))
    return out


def _spec(*args) -> dict:
    keys = ["hidden", "layers", "heads", "vocab", "intermediate", "max_positions", "seed", "dtype"]
    return {"format": SPEC_FORMAT, **dict(zip(keys, args))}
