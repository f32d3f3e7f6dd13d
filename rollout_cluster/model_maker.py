"""`rollout-cluster make-model DIR`: a small Llama with random weights, saved like any HF model.

No model hub is reachable here, so tests and the demo load a model made locally through the
real loading path (config.json + safetensors). No tokenizer: prompts are token ids.
"""
from __future__ import annotations

import json
from pathlib import Path


def make_model(out_dir: str, hidden: int = 128, layers: int = 2, heads: int = 2, vocab: int = 2048,
               intermediate: int | None = None, max_positions: int = 4096, seed: int = 0,
               dtype: str = "float32") -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    if (out / "config.json").exists() and (out / "rollout_model.json").exists():
        spec = json.loads((out / "rollout_model.json").read_text())
        if spec == _spec(hidden, layers, heads, vocab, intermediate, max_positions, seed, dtype):
            return out  # already made with the same spec
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate or 2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, vocab_size=vocab,
                      max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2,
                      tie_word_embeddings=False, torch_dtype=dtype)
    model = LlamaForCausalLM(cfg)
    # Random init gives near-uniform next-token distributions; scale up the head so greedy
    # decoding has clear winners and sampling is not pure noise.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model = model.to(getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    (out / "rollout_model.json").write_text(json.dumps(_spec(hidden, layers, heads, vocab, intermediate,
                                                             max_positions, seed, dtype)))
    return out


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
    return dict(zip(keys, args))
