"""Tensor parallelism through the whole stack, on a machine with at least `--tp` GPUs: one Serve
replica whose vLLM engine spans `--tp` GPUs, a mixed-length greedy batch through the router,
a weights reload on every rank (update_weights) to a checkpoint made with another seed, the batch
again, the first checkpoint back, and the batch a third time. Run on the lent H200 x2 by
`bash scripts/gpu_validate.sh tp` (docs/benchmarks.md, section 4).

    python experiments/gpu-weights-reload/run.py --tp 2 --out OUT

Writes OUT/tp_check.json: each GPU's memory before and after the engine started (every rank
allocates its own KV cache, so every GPU must fill), the batches' lengths and timings, how long
each update_weights took, how many greedy sequences changed with the other weights, and how many
came out as before with the first weights back.
Exits 1 if a check fails.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import time
from pathlib import Path


def gpu_memory_mib() -> list:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return [int(x) for x in out.split()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--model", default="models/tiny-llama-tp")
    ap.add_argument("--size", default="256,2,4,2048",
                    help="hidden,layers,heads,vocab of the random Llama made in --model (2048,24,16,32000: 1.1B)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    from rollout_cluster.model_maker import make_model

    hidden, layers, heads, vocab = (int(x) for x in a.size.split(","))
    t0 = time.monotonic()
    # Two checkpoints of one architecture, other seeds: a reload must change the outputs, and
    # reloading the first must bring them back. Heads and KV heads divisible by the TP size.
    for path, seed in ((a.model, 0), (a.model + "-seed1", 1)):
        make_model(path, hidden=hidden, layers=layers, heads=heads, vocab=vocab, seed=seed, dtype="bfloat16")
    made_s = time.monotonic() - t0
    cfg = {"app_name": "tp", "replicas": 1,
           "engine": {"kind": "vllm", "model": a.model, "dtype": "bfloat16", "max_model_len": 4096,
                      "max_num_seqs": 64, "max_num_batched_tokens": 4096, "tensor_parallel_size": a.tp,
                      "gpu_memory_utilization": 0.3, "enforce_eager": True},
           "resources": {"num_cpus": 1, "num_gpus": 1},
           "router": {"replica_timeout_s": 120}, "policy": {"name": "pull"}}
    report = {"tp": a.tp, "size": a.size, "make_model_s": round(made_s, 1), "gpu_mib_before": gpu_memory_mib()}
    checks = {}
    Path(a.out).mkdir(parents=True, exist_ok=True)
    try:
        run(a, cfg, report, checks)
    finally:  # a failed run still leaves what it measured
        report["checks"] = checks
        (Path(a.out) / "tp_check.json").write_text(json.dumps(report, indent=1))
        print(json.dumps(report, indent=1))
    raise SystemExit(0 if checks and all(checks.values()) else 1)


def run(a, cfg: dict, report: dict, checks: dict) -> None:
    from rollout_cluster import RolloutClient, SamplingSpec
    from rollout_cluster.demo import demo_batch

    t0 = time.monotonic()
    client = RolloutClient.start(cfg, wait_ready_s=600)
    report["start_s"] = round(time.monotonic() - t0, 1)
    report["gpu_mib_after_start"] = gpu_memory_mib()
    grown = [b2 - b1 for b1, b2 in zip(report["gpu_mib_before"], report["gpu_mib_after_start"])]
    checks[f"the engine filled {a.tp} GPUs"] = sum(g > 10_000 for g in grown) >= a.tp
    ids, specs = demo_batch(prompts=16, samples=4, seed=1, max_len=600)
    greedy = [SamplingSpec(n=s.n, max_tokens=s.max_tokens, temperature=0.0, ignore_eos=True, logprobs=0) for s in specs]

    def batch(name: str) -> list:
        t = time.monotonic()
        results = client.generate(ids, greedy, timeout_s=600)
        report[f"{name}_s"] = round(time.monotonic() - t, 2)
        expected = [s.max_tokens for s in greedy for _ in range(s.n)]
        checks[f"{name}: every length exact"] = [len(c.token_ids) for c in results] == expected
        checks[f"{name}: logprobs finite"] = all(len(c.logprobs) == len(c.token_ids) and
                                                 all(math.isfinite(x) and x <= 0 for x in c.logprobs)
                                                 for c in results)
        return results

    def reload(path: str, name: str) -> int:
        t = time.monotonic()
        version = client.update_weights(path)
        report[f"update_weights_{name}_s"] = round(time.monotonic() - t, 2)
        return version

    try:
        first = batch("batch_1")
        v_other = reload(a.model + "-seed1", "other")
        other = batch("batch_2_other_weights")
        v_back = reload(a.model, "back")
        back = batch("batch_3_first_weights_again")
    finally:
        client.shutdown()
    changed = sum(x.token_ids != y.token_ids for x, y in zip(first, other))
    same = sum(x.token_ids == y.token_ids for x, y in zip(first, back))
    report["greedy_changed_with_other_weights"] = f"{changed} of {len(first)}"
    report["greedy_identical_with_first_weights_again"] = f"{same} of {len(first)}"
    checks["other weights: most outputs change"] = changed >= 0.9 * len(first)
    checks["first weights again: outputs as before"] = same >= 0.9 * len(first)
    checks["versions tag the batches"] = ({c.weights_version for c in other} == {v_other} and
                                          {c.weights_version for c in back} == {v_back} and v_back > v_other)

if __name__ == "__main__":
    main()
