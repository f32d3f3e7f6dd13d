"""How much two vLLM-CPU engines on one host slow each other (the CPU benchmark's replicas).

Runs one engine alone, then two at once (each pinned to its own core, as the benchmark pins its
replicas), and prints the decode step time at each batch size, and the CPU share of each engine
process while it decodes. The ratio is the simulator's `--host-slowdown` for this host.

    python experiments/host-interference/run.py --model models/cpu-bench --batches 1,32
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time


def process_cpu_ticks(names=("VLLM",)) -> dict:
    """pid -> (name, user+system ticks) of this host's vLLM processes."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        if name.startswith(names):
            out[pid] = (name, int(fields[11]) + int(fields[12]))
    return out


async def one_engine(model: str, core: int, batch: int, tokens: int) -> dict:
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=model, dtype="float32", max_model_len=4096, max_num_seqs=64, max_num_batched_tokens=4096,
        skip_tokenizer_init=True, disable_log_stats=True, enable_prefix_caching=False))

    async def run(i: int) -> None:
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, detokenize=False)
        async for _ in engine.generate(TokensPrompt(prompt_token_ids=[5 + i] * 32), params, request_id=str(i)):
            pass

    await asyncio.gather(*[run(1000 + i) for i in range(batch)])  # warm-up at this batch size
    t0 = time.perf_counter()
    task = asyncio.gather(*[run(i) for i in range(batch)])
    await asyncio.sleep(1.0)
    before, w0 = process_cpu_ticks(), time.perf_counter()
    await asyncio.sleep(2.0)
    after, w1 = process_cpu_ticks(), time.perf_counter()
    await task
    seconds = time.perf_counter() - t0
    hz = os.sysconf("SC_CLK_TCK")
    cpu = {f"{name} {pid}": round((after[pid][1] - t) / hz / (w1 - w0), 2)
           for pid, (name, t) in before.items() if pid in after}
    engine.shutdown()
    return {"core": core, "batch": batch, "step_ms": round(1e3 * seconds / tokens, 2), "cpu_share": cpu}


def launch(args, core: int, batch: int) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--worker", "--model", args.model, "--core", str(core),
           "--batches", str(batch), "--tokens", str(args.tokens)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def result(proc: subprocess.Popen) -> dict:
    out, _ = proc.communicate(timeout=900)
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/cpu-bench")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--tokens", type=int, default=300, help="decode steps timed per run")
    p.add_argument("--core", type=int, default=0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(asyncio.run(one_engine(args.model, args.core, int(args.batches), args.tokens))))
        return 0
    rows = []
    for batch in map(int, args.batches.split(",")):
        alone = result(launch(args, 0, batch))
        pair = [launch(args, 0, batch), launch(args, 1, batch)]
        both = [result(q) for q in pair]
        shared = sum(r["step_ms"] for r in both) / 2
        rows.append({"batch": batch, "alone_ms": alone["step_ms"], "shared_ms": [r["step_ms"] for r in both],
                     "slowdown": round(shared / alone["step_ms"] - 1, 3),
                     "cpu_share_alone": alone["cpu_share"], "cpu_share_shared": [r["cpu_share"] for r in both]})
        print(json.dumps(rows[-1]), flush=True)
    print("batch  alone ms  two engines ms (each)  slowdown")
    for r in rows:
        print(f"{r['batch']:5d}  {r['alone_ms']:8.1f}  {r['shared_ms'][0]:6.1f} {r['shared_ms'][1]:6.1f}"
              f"          {100 * r['slowdown']:+.0f} %")
    return 0


if __name__ == "__main__":
    sys.exit(main())
