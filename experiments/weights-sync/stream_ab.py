"""push_weights with its later buckets streamed after the order (transfer/push.py) against the
order waiting for every bucket (ROLLOUT_PUSH_STREAM=0), side by side on one running cluster.

    flock /tmp/rollout-e2e.lock env PYTHONPATH=$PWD python experiments/weights-sync/stream_ab.py \\
        --model-dir /work/main/models/llama-111m --rounds 10 --bucket-mb 256 --out results/stream-ab-256

Rounds alternate which way goes first; the weights change before every push. Prints and saves
each push's seconds, the medians and the median paired ratio (waiting / streamed)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from rollout_cluster.config import load_config
from rollout_cluster.transfer.push import STREAM_ENV


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from rollout_cluster.client.client import RolloutClient

    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/local-cpu.yaml")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--bucket-mb", type=float, default=256)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    cfg = load_config(args.config)
    cfg.engine = cfg.engine.model_copy(update={"model": str(Path(args.model_dir).resolve())})
    cfg = cfg.validate()
    trainer = AutoModelForCausalLM.from_pretrained(args.model_dir, torch_dtype=torch.float32)
    client = RolloutClient.start(cfg)
    rows = []
    try:
        for r in range(args.rounds):
            row = {"round": r}
            for way in (("streamed", "waiting") if r % 2 == 0 else ("waiting", "streamed")):
                with torch.no_grad():
                    for p in trainer.parameters():
                        p.mul_(1.0 + 1e-3 * (r + 1))
                os.environ[STREAM_ENV] = "1" if way == "streamed" else "0"
                t0 = time.monotonic()
                client.push_weights(trainer.named_parameters(), bucket_bytes=int(args.bucket_mb * 2**20))
                row[way] = round(time.monotonic() - t0, 3)
            rows.append(row)
            print(f"round {r}: streamed {row['streamed']:.3f} s, waiting {row['waiting']:.3f} s", flush=True)
    finally:
        client.shutdown()
    warm = rows[2:] or rows  # the first pushes touch the object store's memory for the first time (all, under 3 rounds)
    out = {"bucket_mb": args.bucket_mb, "rounds": rows,
           "streamed_median_s": statistics.median(r["streamed"] for r in warm),
           "waiting_median_s": statistics.median(r["waiting"] for r in warm),
           "ratio_median_warm": round(statistics.median(r["waiting"] / r["streamed"] for r in warm), 3)}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "stream_ab.json").write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "rounds"}))


if __name__ == "__main__":
    main()
