"""The trainer's side of an object-store push on a GPU, alone: packing a 7B model's bf16 tensors
into 256 MiB buckets of host memory, each GPU tensor copied into fresh pageable memory
(`tensor.to("cpu")`, ROLLOUT_PUSH_STAGING=0) against one reused, page-locked staging buffer
(transfer/staging.py), alternating, each bucket then copied once more into a reused host buffer
as `ray.put` copies it into the store. Needs torch and a GPU, not vLLM or Ray (no kit):

    python3 experiments/weights-colocated/staging_bench.py --rounds 3 --out $OUT

Prints one JSON line per round and a summary; in the first round about 4,096 bytes sampled evenly
from every staged bucket are compared with the fresh way's (they must be equal).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
try:
    import rollout_cluster  # noqa: F401
except ModuleNotFoundError:  # (a GPU host with torch and no kit: transfer/ needs only torch and numpy)
    import types

    _pkg = types.ModuleType("rollout_cluster")
    _pkg.__path__ = [str(ROOT / "rollout_cluster")]
    sys.modules["rollout_cluster"] = _pkg

from rollout_cluster.transfer.buckets import pack  # noqa: E402
from rollout_cluster.transfer.staging import Staging  # noqa: E402

# Qwen2.5-7B's tensors (bf16: 15.2 GB), generated on the GPU
HIDDEN, LAYERS, KV, INTER, VOCAB = 3584, 28, 512, 18944, 152064


def shapes() -> list:
    out = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", (HIDDEN, HIDDEN)), (p + "self_attn.q_proj.bias", (HIDDEN,)),
                (p + "self_attn.k_proj.weight", (KV, HIDDEN)), (p + "self_attn.k_proj.bias", (KV,)),
                (p + "self_attn.v_proj.weight", (KV, HIDDEN)), (p + "self_attn.v_proj.bias", (KV,)),
                (p + "self_attn.o_proj.weight", (HIDDEN, HIDDEN)),
                (p + "mlp.gate_proj.weight", (INTER, HIDDEN)), (p + "mlp.up_proj.weight", (INTER, HIDDEN)),
                (p + "mlp.down_proj.weight", (HIDDEN, INTER)),
                (p + "input_layernorm.weight", (HIDDEN,)), (p + "post_attention_layernorm.weight", (HIDDEN,))]
    return out + [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]


def one_push(named, bucket_bytes, staging, store, check=None) -> dict:
    """Pack every bucket and copy it into `store` (as ray.put would); times both parts."""
    import numpy as np

    t0 = time.perf_counter()
    pack_s = put_s = 0.0
    n = 0
    it = iter(pack(named, bucket_bytes, staging))
    while True:
        a = time.perf_counter()
        bucket = next(it, None)
        b = time.perf_counter()
        if bucket is None:
            break
        pack_s += b - a
        off = 0
        for d in bucket["data"]:
            np.copyto(store[off:off + d.nbytes], d)
            off += d.nbytes
        if check is not None:
            check.append(bytes(store[:off][:: max(1, off // 4096)]))  # (a sample of the bytes)
        put_s += time.perf_counter() - b
        n += 1
    return {"s": time.perf_counter() - t0, "pack_s": pack_s, "put_s": put_s, "buckets": n}


def main() -> None:
    import numpy as np
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=256)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="this script's control flow on a CPU: 2 layers, transposed CPU tensors (staged too)")
    a = ap.parse_args()
    global LAYERS, VOCAB
    if a.cpu_smoke:
        LAYERS, VOCAB = 2, 4096
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = "cpu" if a.cpu_smoke else "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    named = [(n, torch.randn(s, generator=g, device=dev, dtype=torch.float32).to(torch.bfloat16))
             for n, s in shapes()]
    if a.cpu_smoke:
        named = [(n, t.t().contiguous().t() if t.dim() == 2 else t) for n, t in named]
    total = sum(t.numel() * t.element_size() for _, t in named)
    bucket_bytes = a.bucket_mb << 20
    store = np.empty(max(t.numel() * t.element_size() for _, t in named) + bucket_bytes, dtype=np.uint8)
    store.fill(0)  # (touched: a store that was written before)
    report = {"gpu": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "torch": torch.__version__, "bytes": total,
              "tensors": len(named), "bucket_mb": a.bucket_mb, "rounds": []}
    print(json.dumps({k: v for k, v in report.items() if k != "rounds"}), flush=True)
    stage = Staging()
    checks = {}
    for r in range(a.rounds):
        for way in (("fresh", "staged") if r % 2 == 0 else ("staged", "fresh")):
            check = [] if r == 0 else None
            if dev == "cuda":
                torch.cuda.synchronize()
            got = one_push(named, bucket_bytes, stage if way == "staged" else None, store, check)
            got.update(round=r, way=way, gb_per_s=round(total / got["s"] / 1e9, 2),
                       pinned=stage._pinned if way == "staged" else None)
            if check is not None:
                checks[way] = check
            report["rounds"].append(got)
            print(json.dumps(got), flush=True)
    report["staged_bytes_equal_fresh"] = checks.get("staged") == checks.get("fresh")
    med = {w: statistics.median(x["s"] for x in report["rounds"] if x["way"] == w) for w in ("fresh", "staged")}
    report["summary"] = {"fresh_s": round(med["fresh"], 3), "staged_s": round(med["staged"], 3),
                         "fresh_over_staged": round(med["fresh"] / med["staged"], 2),
                         "staged_bytes_equal_fresh": report["staged_bytes_equal_fresh"]}
    print(json.dumps(report["summary"]), flush=True)
    (out / "staging_bench.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
