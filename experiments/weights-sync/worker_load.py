"""Where vLLM-CPU's in-place reload spends its time, and what a direct load costs instead.

    flock /tmp/rollout-e2e.lock env PYTHONPATH=$PWD /work/main/.venv/bin/python \
        experiments/weights-sync/worker_load.py --model /work/main/models/llama-111m --repeats 3

One vLLM engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so the model is reachable).
Each repeat loads the tensors of model B (another seed) and then of A, each way in turn:
  layerwise: vLLM's own reload (initialize_layerwise_reload, model.load_weights, finalize), what
             reload_weights and our push path ran, timed part by part;
  direct:    engines/direct_load.py's DirectLoad (the push path's load since this experiment).
After every load of B the greedy tokens of 3 prompts must equal those after the layerwise load
(the same weights went in), and after A those of the engine as it started.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def timed(table: dict, key: str, fn):
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            table[key] += time.perf_counter() - t
    wrapper.__wrapped__ = fn
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/work/main/models/llama-111m")
    ap.add_argument("--other", default="/tmp/weights-sync-models/b", help="model B (made here: another seed)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=256.0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    import torch
    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers import linear, vocab_parallel_embedding
    from vllm.model_executor.model_loader.reload import layerwise

    from rollout_cluster.engines import bucket_files
    from rollout_cluster.model_maker import make_model

    cfg = json.loads((Path(a.model) / "config.json").read_text())
    other = make_model(a.other, hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"],
                       heads=cfg["num_attention_heads"], vocab=cfg["vocab_size"], seed=1)
    items = {"a": list(load_file(str(Path(a.model) / "model.safetensors")).items()),
             "b": list(load_file(str(Path(other) / "model.safetensors")).items())}
    nbytes = sum(t.numel() * t.element_size() for _, t in items["a"])
    # packed buckets as the worker sees them (a flat uint8 buffer + header), built once
    packed = {}
    for k, its in items.items():
        buckets, cur, size = [], [], 0
        for name, t in its:
            if cur and size + t.numel() * t.element_size() > a.bucket_mb * 2**20:
                buckets.append(cur)
                cur, size = [], 0
            cur.append((name, t))
            size += t.numel() * t.element_size()
        packed[k] = [bucket_files.pack_bucket(b) for b in buckets + [cur] if b]

    llm = LLM(model=a.model, dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=512,
              enable_prefix_caching=False)
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    model, vcfg = runner.get_model(), runner.vllm_config
    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7, 8, 9], [11, 12, 13], [100, 200, 300, 400])]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def greedy():
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]

    start_tokens = greedy()
    parts = defaultdict(float)
    layerwise.materialize_layer = timed(parts, "materialize", layerwise.materialize_layer)
    layerwise._copy_and_restore_kernel_tensors = timed(parts, "copy_back", layerwise._copy_and_restore_kernel_tensors)
    for cls in (linear.UnquantizedLinearMethod, vocab_parallel_embedding.UnquantizedEmbeddingMethod):
        cls.process_weights_after_loading = timed(parts, "process (oneDNN prepack)", cls.process_weights_after_loading)

    from vllm.config import set_current_vllm_config

    def load_layerwise(key):
        with set_current_vllm_config(vcfg), torch.no_grad():
            t = time.perf_counter()
            layerwise.initialize_layerwise_reload(model)
            parts["initialize"] += time.perf_counter() - t
            for header, buf in packed[key]:
                t = time.perf_counter()
                model.load_weights(bucket_files.unpack_bucket(header, buf))
                parts["load_weights (buffer + loaders + the above)"] += time.perf_counter() - t
            t = time.perf_counter()
            layerwise.finalize_layerwise_reload(model, vcfg.model_config)
            parts["finalize"] += time.perf_counter() - t

    from rollout_cluster.engines.direct_load import DirectLoad, supported

    assert supported(model)
    pool = []

    def load_direct(key):
        with set_current_vllm_config(vcfg), torch.no_grad():
            t = time.perf_counter()
            d = DirectLoad(model, pool)
            parts["initialize"] += time.perf_counter() - t
            for header, buf in packed[key]:
                t = time.perf_counter()
                d.load(bucket_files.unpack_bucket(header, buf))
                parts["load_weights (loaders + the above)"] += time.perf_counter() - t
            t = time.perf_counter()
            d.finish()
            parts["finalize"] += time.perf_counter() - t

    rows = defaultdict(list)
    reference = None
    for r in range(a.repeats):
        for way, fn in (("layerwise", load_layerwise), ("direct", load_direct)):
            for key in ("b", "a"):
                parts.clear()
                t = time.perf_counter()
                fn(key)
                dt = time.perf_counter() - t
                rows[way].append(dt)
                for p, v in parts.items():
                    rows[f"{way}: {p}"].append(v)
                out = greedy()
                if key == "b":
                    reference = reference or out
                    assert out == reference, (way, r, out, reference)
                    assert out != start_tokens
                else:
                    assert out == start_tokens, (way, r, "back to A")
            print(f"repeat {r} {way} (A): {rows[way][-1]:.3f} s " +
                  ", ".join(f"{p} {v:.3f}" for p, v in parts.items()), flush=True)
    med = {k: round(statistics.median(v), 4) for k, v in rows.items()}
    res = {"model": a.model, "bytes": nbytes, "bucket_mb": a.bucket_mb, "buckets": len(packed["a"]),
           "repeats": a.repeats, "seconds": rows, "median_s": med, "loadavg_at_end": os.getloadavg()}
    print(json.dumps(med, indent=1))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
