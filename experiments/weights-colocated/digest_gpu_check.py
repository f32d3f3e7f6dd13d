"""The weights digest (engines/weight_digest.py) on a GPU: equal to the CPU's for the same bytes
(dtypes, odd lengths, chunk sizes), and its time and scratch memory over a 7B model's shapes
(Qwen2.5-7B, bf16, 15.2 GB). Loads weight_digest.py by path: it needs torch only.

    python3 experiments/weights-colocated/digest_gpu_check.py
    DIGEST_LAYERS=1 python3 experiments/weights-colocated/digest_gpu_check.py   # no GPU: the CPU, one layer
"""
import importlib.util
import json
import os
import time
from pathlib import Path

import torch

spec = importlib.util.spec_from_file_location(
    "weight_digest", Path(__file__).resolve().parents[2] / "rollout_cluster" / "engines" / "weight_digest.py")
wd = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wd)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
out = {"device": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu", "torch": torch.__version__}
g = torch.Generator().manual_seed(0)
checks = 0
for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.bool, torch.float64):
    for n in (0, 1, 3, 1001, 3_000_001):
        t = (torch.randn(n, generator=g) * 50).to(dtype)
        cpu = wd.bits_digest(t, chunk=1 << 20)
        for chunk in (1 << 10, 1 << 20, 1 << 24):
            assert wd.bits_digest(t.to(DEV), chunk=chunk) == cpu, (dtype, n, chunk)
            checks += 1
out["gpu_equals_cpu_checks"] = checks

# Qwen2.5-7B's parameter shapes (28 layers), bf16, filled with random bits
H, I, V, KV = 3584, 18944, 152064, 512
L = int(os.environ.get("DIGEST_LAYERS", 28))
shapes = [("embed", (V, H)), ("lm_head", (V, H))]
for i in range(L):
    shapes += [(f"{i}.qkv", (H + 2 * KV, H)), (f"{i}.qkv_b", (H + 2 * KV,)), (f"{i}.o", (H, H)),
               (f"{i}.gate_up", (2 * I, H)), (f"{i}.down", (H, I)), (f"{i}.ln1", (H,)), (f"{i}.ln2", (H,))]
shapes.append(("norm", (H,)))
params = [(n, torch.empty(s, dtype=torch.int16, device=DEV).random_(-32768, 32767).view(torch.bfloat16))
          for n, s in shapes]  # random bits
nbytes = sum(p.numel() * 2 for _, p in params)
for chunk in (1 << 22, 1 << 24, 1 << 26):
    sync()
    base = torch.cuda.memory_allocated() if DEV == "cuda" else 0
    if DEV == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    d = wd.model_digest(params, chunk)
    sync()
    s = time.perf_counter() - t0
    out[f"chunk_{chunk}"] = {"seconds": round(s, 3), "GB_per_s": round(nbytes / s / 1e9, 1),
                             "scratch_peak_MiB": round((torch.cuda.max_memory_allocated() - base) / 2**20, 1) if DEV == "cuda" else None,
                             "digest": d["digest"]}
out["bytes"] = nbytes
out["params"] = len(params)
# one flipped bit in the middle of the largest tensor changes its digest and the combined one
name, big = params[3]
before = wd.tensor_digest(big)
flat = big.view(-1).view(torch.int16)
flat[flat.numel() // 2] ^= 1
out["one_bit_flip_detected"] = wd.tensor_digest(big) != before
print(json.dumps(out, indent=1))
