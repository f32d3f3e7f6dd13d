"""`rollout-cluster weights-sync`: what a trainer pays to get new weights into every replica, two ways,
side by side on one running cluster.

- checkpoint: `save_pretrained` to a folder under the config's checkpoint roots, the manifest
  written last, then `update_weights` (every replica reads the folder and reloads in place);
- push: `push_weights` of the same tensors from the trainer's memory (Ray's object store, then
  every replica loads in place; no file).

The model is made locally (`--hidden`, `--layers`: 768 x 18 is a 111M-parameter Llama) and served
by a copy of the config pointing at it. Rounds alternate the order; each sync sends the weights
of a model with another seed, so every load changes the weights. The answer is the median of each
way and the median of the paired ratios checkpoint / push.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from ..config import load_config
from ..engines.worker_loader import LOAD_ENV
from ..transfer.trace import mark
from .report import save_result
from .repeats import median


def weights_sync(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from ..client.client import RolloutClient
    from ..engines.checkpoint import write_manifest
    from ..model_maker import make_model

    model_dir = Path(args.model_dir)
    make_model(str(model_dir), hidden=args.hidden, layers=args.layers, heads=args.heads)
    cfg = load_config(args.config)
    cfg.engine = cfg.engine.model_copy(update={"model": str(model_dir.resolve())})
    ckpt_root = Path(args.checkpoints).resolve()
    ckpt_root.mkdir(parents=True, exist_ok=True)
    cfg.security = cfg.security.model_copy(update={"checkpoint_roots": [str(ckpt_root), str(model_dir.parent.resolve())]})
    cfg = cfg.validate()
    trainer = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    params = sum(p.numel() for p in trainer.parameters())
    client = RolloutClient.start(cfg)
    rounds = []
    try:
        for r in range(args.rounds):
            row = {"round": r}
            for way in (("checkpoint", "push") if r % 2 == 0 else ("push", "checkpoint")):
                with torch.no_grad():  # new weights every sync: the trainer's step
                    for p in trainer.parameters():
                        p.mul_(1.0 + 1e-3 * (len(rounds) + 1))
                t0 = time.monotonic()
                mark(way + "_start", round=r)
                if way == "checkpoint":
                    with tempfile.TemporaryDirectory(dir=ckpt_root) as d:
                        trainer.save_pretrained(d)
                        write_manifest(d)
                        saved = time.monotonic()
                        mark("checkpoint_saved")
                        client.update_weights(d)
                        row["checkpoint_save_s"] = round(saved - t0, 3)
                else:
                    client.push_weights(trainer.named_parameters(), bucket_bytes=int(args.bucket_mb * 2**20))
                mark(way + "_end")
                row[way + "_s"] = round(time.monotonic() - t0, 3)
            rounds.append(row)
            print(f"round {r}: checkpoint {row['checkpoint_s']:.2f} s (save {row['checkpoint_save_s']:.2f}), "
                  f"push {row['push_s']:.2f} s", flush=True)
        out = client.generate([[5, 6, 7]], None)  # the fleet still serves after the last sync
        assert out and out[0].finish_reason in ("length", "stop")
    finally:
        client.shutdown()
    result = {"model": str(model_dir), "parameters": params, "bytes": params * 4, "replicas": cfg.replicas,
              "bucket_mb": args.bucket_mb, "tensor_load": os.environ.get(LOAD_ENV, "direct"),
              "rounds": rounds, "checkpoint_median_s": median([r["checkpoint_s"] for r in rounds]),
              "push_median_s": median([r["push_s"] for r in rounds]),
              "speedup_median": round(median([r["checkpoint_s"] / r["push_s"] for r in rounds]), 2)}
    lines = [f"# Weight sync: {params / 1e6:.0f}M parameters (float32, {params * 4 / 2**20:.0f} MiB) to "
             f"{cfg.replicas} replicas, {args.rounds} rounds", "",
             "| way | median (s) |", "|---|---|",
             f"| save_pretrained + manifest + update_weights | {result['checkpoint_median_s']:.2f} |",
             f"| push_weights | {result['push_median_s']:.2f} |", "",
             f"Median paired speedup of push: {result['speedup_median']:.2f}x"]
    save_result(args.out, "weights_sync", result, lines)
    return result
