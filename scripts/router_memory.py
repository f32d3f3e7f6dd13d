"""Router memory per generated token: a RouterCore (as the Serve router runs it, tokens and
logprobs kept) takes an rl-longtail batch whose progress arrives as replicas report it, 8 tokens a
delta, pickled as Ray sends a report; tracemalloc measures the peak of what the router holds, or
(--cpu) the router's CPU time per token to unpickle and apply the reports. No Ray, no vLLM.

    python scripts/router_memory.py [--prompts 64] [--samples 16] [--logprobs] [--cpu]

Prints JSON: peak bytes, generated tokens, bytes per token (or, with --cpu, the router's CPU time
in on_report per token). Run it against two checkouts (PYTHONPATH=...) to compare versions.
"""
from __future__ import annotations

import argparse
import json
import pickle
import random
from array import array
import time
import tracemalloc

from rollout_cluster.bench.workloads import LongtailSpec, rl_longtail
from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.router.core import RouterCore
from rollout_cluster.protocol import EngineStats, ModelInfo, Report, SamplingSpec, SeqProgress


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--logprobs", action="store_true", help="keep a logprob per token, as RL trainers ask")
    ap.add_argument("--deltas", choices=("list", "array"), default="list",
                    help="how engines send token ids and logprobs: lists (as they do), or arrays (which unpickle slower in 8-token deltas)")
    ap.add_argument("--cpu", action="store_true",
                    help="measure the router's CPU time in on_report per token instead (tracemalloc off)")
    a = ap.parse_args()
    reqs = rl_longtail(LongtailSpec(prompts=a.prompts, samples=a.samples), vocab_size=32000)
    spec = SamplingSpec(max_tokens=16384, ignore_eos=True, logprobs=0 if a.logprobs else None)
    for r in reqs:
        r.sampling = spec
    core = RouterCore(make_policy(PolicyConfig(name="pull"), load_profile("h200-1.5b")),
                      expected_replicas=a.replicas, replica_timeout_s=1e9, record_tokens=True)
    rids = [f"r{i}" for i in range(a.replicas)]
    model = ModelInfo(vocab_size=32000, max_model_len=20480)
    for rid in rids:
        core.on_report(Report(rid, "1", progress=[], stats=EngineStats(), model=model, capacity=4096), 0.0)
    rng = random.Random(0)
    if not a.cpu:
        tracemalloc.start()
    cpu = 0.0
    bid = core.submit(reqs, 0.0)
    held = {rid: [] for rid in rids}  # (work, produced, length)
    now, done = 0.0, False
    while not done:
        now += 0.05
        for rid in rids:
            progress, left = [], []
            for work, produced, length in held[rid]:
                n = min(8, length - produced)
                toks = [rng.randrange(32000) for _ in range(n)]
                lps = [-rng.random() * 5 for _ in range(n)] if a.logprobs else None
                if a.deltas == "array":
                    toks, lps = array("i", toks), None if lps is None else array("d", lps)
                finish = "length" if produced + n >= length else None
                progress.append(SeqProgress(work.seq_id, work.attempt, toks, lps, finish, offset=produced))
                if finish is None:
                    left.append((work, produced + n, length))
            sent = pickle.dumps(Report(rid, "1", progress=progress, stats=EngineStats(), model=None, capacity=4096))  # as Ray sends it
            t0 = time.process_time()
            orders = core.on_report(pickle.loads(sent), now)
            cpu += time.process_time() - t0
            held[rid] = left + [(w, 0, core.seqs[w.seq_id].request.hidden_length) for w in orders.start]
        done = core.batches[bid].size == len(core.batches[bid].order)
    tokens = core.counters.generated_tokens
    out = {"sequences": len(reqs), "generated_tokens": tokens, "logprobs": a.logprobs, "deltas": a.deltas}
    if a.cpu:
        out.update(router_cpu_s=round(cpu, 3), router_cpu_us_per_token=round(1e6 * cpu / tokens, 3))
    else:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        out.update(peak_bytes=peak, bytes_per_token=round(peak / tokens, 2))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
