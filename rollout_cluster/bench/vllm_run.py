"""`bench --engine vllm`: every policy on one live cluster (Ray Serve + vLLM replicas).

The cluster starts once (RolloutClient.start); one small warm-up batch runs first so that
compilation is not measured; then, per seed and per policy: set_policy, set_trace, run the batch
and time it in the driver. Each policy gets the same lengths but fresh random prompt ids, so no
run finds the previous one's prompts in the prefix cache. `--repeats N` runs every seed's batch N
times per policy and reports the median run (bench/repeats.py). Bounds come from --profile (a
calibrated YAML from `rollout-cluster calibrate`); the output says which.

`--bare-engine` then (after the cluster is down, so nothing competes for the cores) runs the
same batches on ONE bare vLLM AsyncLLM in a spawned process, all requests in flight at once,
with the config's scheduler limits, and reports router_overhead_pct against the 1-replica pull run.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import time
from pathlib import Path

from ..protocol import SamplingSpec, SequenceRequest, Work
from .bounds import bounds
from .report import trace_by_replica
from .run import (PREFILLED, cluster_config, cost_model, header, percentile, policy_config, policy_metrics, tail_s,
                  workload)

DEFAULT_CONFIG = "configs/local-cpu.yaml"
WARMUP_TOKENS = 16


def utilization(by_replica: dict, makespan: float, replicas: int) -> float:
    """Mean fraction of [0, makespan] in which a replica held work, from the pull trace: a
    replica holds what it reported at a pull until its next pull."""
    if makespan <= 0:
        return 0.0
    busy = 0.0
    for points in by_replica.values():
        for (t, held), (t_next, _) in zip(points, points[1:] + [(makespan, 0)]):
            lo, hi = max(0.0, t), min(makespan, t_next)
            if held > 0 and hi > lo:
                busy += hi - lo
    return min(1.0, busy / (replicas * makespan))


def warmup_batch(replicas: int, vocab_size: int) -> list:
    """A few short sequences per replica: triggers compilation and the first allocations."""
    spec = SamplingSpec(max_tokens=WARMUP_TOKENS, ignore_eos=True)
    low = 3 if vocab_size > 4 else 0
    return [SequenceRequest([low + (i * 7 + j) % (vocab_size - low) for j in range(24 + i % 8)], spec, i, 0,
                            hidden_length=WARMUP_TOKENS) for i in range(4 * replicas)]


def check_fits(requests: list, model: dict) -> None:
    """Refuse a workload the model's context cannot hold, before anything runs."""
    worst = max(r.prompt_len + r.sampling.max_tokens for r in requests)
    if worst > model["max_model_len"]:
        raise ValueError(f"workload needs prompt + max_tokens = {worst} tokens, above the model's "
                         f"max_model_len={model['max_model_len']}: lower --max-tokens/--prompt-max or raise "
                         "engine.max_model_len in the config")


def chunk_reprefill(requests: list, lengths: list, chunk: int) -> int:
    """Tokens `chunked` re-prefills: a sequence of length L restarts after every full chunk with
    prompt + k*chunk tokens. The router counts only migrations, not these rounds."""
    return sum(r.prompt_len + k * chunk for r, n in zip(requests, lengths) for k in range(1, -(-n // chunk)))


def run_policy(client, name: str, requests: list, cfg, lower: float, timeout_s: float) -> tuple:
    """(metrics row, trace {replica: [(t, held)]}, step samples [(running, context, s per token)])
    of one policy's batch on the live cluster."""
    settings = policy_config(cfg.policy, name)
    client.set_policy(name, **settings.model_dump(exclude={"name"}))
    client.set_trace(True)
    before = client.status()
    t0 = time.monotonic()
    completions = client.run_requests(requests, timeout_s=timeout_s)
    makespan = time.monotonic() - t0
    status = client.status()
    trace = trace_by_replica(client.take_trace(client.last_batch_id))
    samples = client.take_step_samples()
    bad = [c for c in completions if c is None or c.finish_reason == "error"]
    if bad:
        raise RuntimeError(f"policy {name}: {len(bad)} sequences failed, first: {getattr(bad[0], 'error', None)}")
    counters = status["counters"]
    generated = sum(len(c.token_ids) for c in completions)
    reprefill = counters["reprefill_tokens"]
    if name == "chunked":
        reprefill += chunk_reprefill(requests, [len(c.token_ids) for c in completions], settings.chunk_tokens)
    row = policy_metrics(makespan, [c.finish_time_s for c in completions], generated,
                         utilization(trace, makespan, cfg.replicas),
                         sum(m.reason == "policy" for c in completions for m in c.migrations), reprefill,
                         (status["decision_ms_mean"], status["decision_ms_p99"]), lower)
    # What the engines reported actually prefilling for continuations (vLLM's num_cached_tokens
    # taken out); unknown if continuations ran but none reported it.
    measured = counters.get("reprefill_segments_measured", 0)
    row[PREFILLED] = (round(100.0 * counters.get("reprefilled_tokens", 0) / generated, 3)
                      if generated and (measured or not reprefill) else None)
    row["median_finish_s"] = round(percentile([c.finish_time_s for c in completions], 0.5), 4)
    row["router_rss_peak_mb"] = status.get("router_rss_peak_mb")  # over the router's life: this run and those before
    # The router's CPU: the share of one core it used during the batch, and pulls it answered a second.
    if makespan > 0:
        row["router_cpu_share"] = round((status["router_cpu_s"] - before["router_cpu_s"]) / makespan, 4)
    was = before["replicas"]
    pulls = sum(r["pulls"] - (was[rid]["pulls"] if rid in was else 0) for rid, r in status["replicas"].items())
    row["pulls_per_s"] = round(pulls / makespan, 1) if makespan > 0 else 0.0
    if counters["generated_tokens"] != generated:
        row["router_generated_tokens"] = counters["generated_tokens"]  # a disagreement worth seeing
    return row, trace, samples


def bound_note(args, cfg, cost) -> str:
    """Which profile the bounds come from; a built-in profile is not this engine's."""
    source = args.profile or cfg.profile_path()
    if Path(source).exists():
        return f"bounds from the calibrated profile {source} (cost model {cost.name})"
    return (f"bounds from profile {cost.name}, NOT calibrated on this engine: ratios are indicative only "
            "(run `rollout-cluster calibrate` and pass --profile FILE.yaml)")


def bench_vllm(args, policies: list, seeds: list) -> tuple:
    """(bench dict, traces of the first seed). Starts and stops one cluster."""
    from ..client.client import RolloutClient
    from .run import combine

    args.config = args.config or DEFAULT_CONFIG
    cfg = cluster_config(args)
    args.replicas = cfg.replicas
    cost = cost_model(args, cfg)
    note = bound_note(args, cfg, cost)
    print(note)
    client = RolloutClient.start(cfg)
    try:
        runs, traces, batches, vocab = bench_on_cluster(client, cfg, args, policies, seeds, cost, note)
    finally:
        client.shutdown()
    if getattr(args, "bare_engine", False):
        for run, bare in zip(runs, run_bare_engine(cfg, batches, warmup_batch(1, vocab))):
            run["bare_engine"] = bare_summary(bare, run, cfg)
    result = combine(runs, seeds)
    if len(runs) > 1 and runs[0].get("bare_engine"):
        result["bare_engine"] = [r["bare_engine"] for r in runs]
    return result, traces


def bench_on_cluster(client, cfg, args, policies: list, seeds: list, cost, note: str) -> tuple:
    """(runs per seed, traces of the first seed, bare-engine batches, vocab size) on a running
    cluster. With args.repeats = N > 1, every policy runs each seed's batch N times in rotated
    order (bench/repeats.py) and a seed's row is the median run."""
    from tqdm import tqdm

    from .repeats import round_order, summarize_seed

    repeats = int(getattr(args, "repeats", 1) or 1)
    runs, traces, batches, step_samples = [], None, [], {}
    model = client.status()["model"]
    vocab = int(model["vocab_size"])
    client.run_requests(warmup_batch(cfg.replicas, vocab), timeout_s=args.timeout_s)
    with tqdm(total=len(seeds) * len(policies) * repeats, desc="bench (vllm)", unit="run") as bar:
        for seed in seeds:
            requests, desc = workload(args, seed)
            check_fits(requests, model)
            b = bounds(requests, cost, cfg.replicas)
            run = header("vllm", cfg.replicas, desc, b, cost, note)
            run["replica_engine"] = cfg.engine.kind  # "sim": the live cluster's replicas host simulated engines
            rows = {name: [] for name in policies}
            seed_traces = {name: [] for name in policies}
            for r in range(repeats):
                for name in round_order(policies, r):
                    bar.set_postfix_str(f"seed {seed} {name}" + (f" round {r}" if repeats > 1 else ""))
                    salt = f"-{name}" if repeats == 1 else f"-{name}-r{r}"
                    reqs, _ = workload(args, seed, vocab, ids_salt=salt)
                    row, trace, samples = run_policy(client, name, reqs, cfg, b["lower_bound_s"], args.timeout_s)
                    rows[name].append(row)
                    seed_traces[name].append(trace)
                    step_samples[f"seed {seed} {name}" + (f" r{r}" if repeats > 1 else "")] = samples
                    bar.update(1)
            if repeats > 1:
                results, picked, run["repeats"] = summarize_seed(rows)
                run["results"] = {name: results[name] for name in policies}
            else:
                picked = {name: 0 for name in policies}
                run["results"] = {name: rows[name][0] for name in policies}
            runs.append(run)
            batches.append(workload(args, seed, vocab, ids_salt="-bare")[0])
            traces = traces or {name: seed_traces[name][picked[name]] for name in policies}
    if step_samples and getattr(args, "out", None):  # for `calibrate --from-samples`
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "step_samples.json").write_text(json.dumps(step_samples))
    return runs, traces, batches, vocab


def bare_summary(bare: dict, run: dict, cfg) -> dict:
    """The bare engine's figures beside the 1-replica pull run of the same seed."""
    out = {"makespan_s": round(bare["makespan_s"], 4),
           "tokens_per_s": round(bare["tokens"] / bare["makespan_s"], 2) if bare["makespan_s"] else 0.0,
           "tail_s": round(tail_s(bare["finish_times"]), 4),
           "median_finish_s": round(percentile(bare["finish_times"], 0.5), 4),
           "max_num_seqs": cfg.engine.max_num_seqs, "max_num_batched_tokens": cfg.engine.max_num_batched_tokens,
           "router_overhead_pct": None}
    pull = run["results"].get("pull")
    if cfg.replicas == 1 and pull:
        out["router_overhead_pct"] = round(100.0 * (pull["makespan_s"] - bare["makespan_s"]) / bare["makespan_s"], 2)
    else:
        out["note"] = "router_overhead_pct needs --replicas 1 and pull among --policies"
    return out


# ---- one bare AsyncLLM in a spawned process -------------------------------------------------
def run_bare_engine(cfg, batches: list, warmup: list) -> list:
    """[{makespan_s, tokens, finish_times}] per batch, from one bare AsyncLLM (spawned process)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_bare_main, args=(cfg.engine, cfg.model_path(), batches, warmup, queue))
    proc.start()
    try:
        result = queue.get(timeout=3600)
    finally:
        proc.join(timeout=120)
        if proc.is_alive():
            proc.terminate()
    if isinstance(result, str):
        raise RuntimeError(f"bare engine failed: {result}")
    return result


def _bare_main(engine_cfg, model: str, batches: list, warmup: list, queue) -> None:
    """Entry point of the spawned process: report the results, or the error as a string. The
    process then exits at once: the engine is already shut down, and letting the interpreter
    tear down would run AsyncLLM.__del__ against half-unloaded modules."""
    try:
        queue.put(asyncio.run(bare_batches(engine_cfg, model, batches, warmup)))
    except BaseException as e:  # noqa: BLE001  (the parent must hear of any failure)
        queue.put(f"{type(e).__name__}: {e}")
    queue.close()
    queue.join_thread()
    os._exit(0)


async def bare_batches(engine_cfg, model: str, batches: list, warmup: list) -> list:
    """One bare AsyncLLM runs `warmup`, then each batch with every request in flight at once; per
    batch its makespan, tokens and finish times."""
    from vllm.v1.engine.async_llm import AsyncLLM

    from ..engines.engine_env import apply_engine_env
    from ..engines.vllm_engine import engine_args, is_cpu_build

    apply_engine_env(engine_cfg, 0, is_cpu_build())
    engine = AsyncLLM.from_engine_args(engine_args(engine_cfg, model))
    try:
        await all_in_flight(engine, warmup, "warmup")
        out = []
        for b, requests in enumerate(batches):
            t0 = time.monotonic()
            done = await all_in_flight(engine, requests, f"b{b}")
            out.append({"makespan_s": time.monotonic() - t0, "tokens": sum(n for n, _ in done),
                        "finish_times": [t - t0 for _, t in done]})
        return out
    finally:
        engine.shutdown()


async def all_in_flight(engine, requests: list, tag: str) -> list:
    """Submit every request at once; [(tokens, finish time)] in request order."""
    from vllm.inputs import TokensPrompt

    from ..engines.vllm_engine import sampling_params

    async def one(i: int, r: SequenceRequest):
        work = Work(f"{tag}-{i}", 1, r.prompt_token_ids, r.sampling, stop_after=r.hidden_length)
        n = 0
        async for out in engine.generate(TokensPrompt(prompt_token_ids=r.prompt_token_ids), sampling_params(work),
                                         request_id=f"{tag}-{i}"):
            n += len(out.outputs[0].token_ids)  # DELTA outputs
        return n, time.monotonic()

    return await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
