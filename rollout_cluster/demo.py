"""`rollout-cluster demo`: a local CPU cluster runs one mixed-length batch and prints a summary."""
from __future__ import annotations

import random
import time
from collections import Counter
from pathlib import Path

from .config import load_config
from .protocol import SamplingSpec, partials


def demo_batch(prompts: int = 16, samples: int = 4, seed: int = 0, max_len: int = 400):
    """Prompts of 8-48 tokens; per-prompt lengths drawn long-tailed, shared by the group's samples."""
    rng = random.Random(seed)
    ids, specs = [], []
    for _ in range(prompts):
        ids.append([rng.randrange(3, 2000) for _ in range(rng.randint(8, 48))])
        length = int(min(max_len, max(16, rng.lognormvariate(4.5, 0.8))))
        specs.append(SamplingSpec(n=samples, max_tokens=length, temperature=1.0, ignore_eos=True, logprobs=0, seed=None))
    return ids, specs


def partial_rollout_steps(client, ids: list, specs: list, fraction: float) -> dict:
    """Cut a batch at `fraction` (generate's finish_fraction), then finish its cut samples in a
    second batch, continued after their tokens: what an RL step with partial rollouts does."""
    t0 = time.monotonic()
    first = client.generate(ids, specs, finish_fraction=fraction)
    cut_s = time.monotonic() - t0
    cut = [c for c in first if c.finish_reason == "abort"]
    carry, cut_specs = partials(ids, first), [specs[c.prompt_index] for c in cut]
    t1 = time.monotonic()
    second = client.generate(carry, cut_specs) if carry else []
    return {"finish_fraction": fraction, "cut_step_s": round(cut_s, 2), "cut_off": len(cut),
            "resumed_step_s": round(time.monotonic() - t1, 2) if carry else 0.0,
            "resumed_tokens": sum(c.resumed_tokens for c in second),
            "resumed_to_full_length": sum(len(c.token_ids) == spec.max_tokens for c, spec in zip(second, cut_specs))}


def run_demo(config_path: str, prompts: int = 16, samples: int = 4) -> dict:
    from .client.client import RolloutClient
    from .model_maker import make_model

    cfg = load_config(config_path)
    model_dir = Path(cfg.model_path())
    if cfg.engine.kind == "vllm" and not model_dir.exists() and not cfg.engine.load_format == "dummy":
        print(f"making the local model in {model_dir} ...")
        make_model(str(model_dir))
    print(f"starting a local Ray cluster with {cfg.replicas} {cfg.engine.kind} replicas (about a minute) ...")
    client = RolloutClient.start(cfg)
    try:
        ids, specs = demo_batch(prompts, samples)
        t0 = time.monotonic()
        results = client.generate(ids, specs, progress=True)
        makespan = time.monotonic() - t0
        status = client.status()
        print("partial rollouts: the same batch cut at 90 %, then its cut samples resumed ...")
        partial = partial_rollout_steps(client, ids, specs, 0.9)
    finally:
        client.shutdown()
    tokens = sum(len(r.token_ids) for r in results)
    per_replica = Counter(rep for r in results for rep in r.replicas[:1])
    summary = {
        "sequences": len(results), "tokens": tokens, "makespan_s": round(makespan, 2),
        "tokens_per_s": round(tokens / makespan, 1),
        "per_replica_sequences": dict(per_replica), "migrations": status["counters"]["migrations"],
        "finish_reasons": dict(Counter(r.finish_reason for r in results)),
        "policy": status["policy"],
        "partial_rollouts": partial,
    }
    print("\nrollout summary")
    for k, v in summary.items():
        print(f"  {k:22s} {v}")
    return summary
