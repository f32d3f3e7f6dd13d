"""`rollout-cluster overhead`: the cluster against bare AsyncLLMs, in paired rounds.

With one replica (the default), the cluster (policy `pull`) against one bare AsyncLLM. With
`--replicas N`, the cluster of N replicas (the config's policy) against N bare AsyncLLMs placed as
the replicas are (engine rank i: on a CPU, replica i's core), which split the batch as an offline
data-parallel job does: each engine takes a contiguous share of the prompts, every sample of a
prompt on the same engine, all at once; the bare side's makespan is the slowest engine's.

Separate engine instances differ by a few percent from one run to the next, so one pair of runs
cannot resolve a 2 % overhead. Here both stay up side by side (on a GPU each takes
--memory-fraction of it) and take turns on the same batch: for every seed, `--rounds` rounds,
each running the batch on both, in an order that alternates from round to round (and seed to
seed), with fresh prompt ids every run so that no run finds another's prefix cache. The answer is
the median over all pairs of (cluster / bare - 1), with its spread and each seed's median.
`--control` keeps a second bare engine up, started after the cluster, in the rotation: its
difference from the first is what two engine instances differ by without any cluster, and the
cluster is also reported against the mean of both bare engines of its round.

Both have the config's scheduler limits (max_num_seqs, max_num_batched_tokens); the bare engine
runs every request of the batch at once, as an offline job would. With ROLLOUT_TIMELINE_DIR set,
the replica and the bare engine write their timelines (serve/timeline.py).
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import time
from pathlib import Path

from ..config import PolicyConfig
from .flags import FlagError
from .repeats import median, only_pairs, round_order
from .run import cluster_config, fill_defaults, percentile, tail_s, workload
from .vllm_run import all_in_flight, warmup_batch


def overhead(args) -> dict:
    from ..client.client import RolloutClient

    args.engine = "vllm"
    fill_defaults(args)
    if args.config is None:
        raise FlagError("overhead needs --config (the cluster whose engine is measured, alone and behind the router)")
    replicas = 1 if args.replicas is None else args.replicas
    if replicas < 1:
        raise FlagError(f"--replicas {replicas}: must be at least 1")
    if args.control and replicas > 1:
        raise FlagError(f"--control with --replicas {replicas}: the control is a second bare engine beside one "
                        "replica; measure the control with --replicas 1")
    cfg = cluster_config(args)
    engine = cfg.engine.model_copy(update={"gpu_memory_utilization": args.memory_fraction})
    cfg = cfg.model_copy(update={"replicas": replicas, "engine": engine})
    if replicas == 1 and cfg.policy.name != "pull":
        cfg.policy = PolicyConfig(name="pull")  # one replica: the plainest dispatch
    cfg = cfg.validate()
    seeds = list(args.seeds)  # (cli_types.int_list)
    only = only_pairs(getattr(args, "only", None), seeds, args.rounds)
    bare = BareEngines(cfg, replicas)  # first: its memory is taken before the replicas'
    client = RolloutClient.start(cfg)
    # The control: a second bare engine, started last. Its difference from the first bare engine
    # is what separate engine instances (and their start order) make on their own.
    control = BareEngine(cfg, "control") if args.control else None
    try:
        vocab = int(client.status()["model"]["vocab_size"])
        client.run_requests(warmup_batch(replicas, vocab), timeout_s=args.timeout_s)
        bare.run(warmup_batch(replicas, vocab), "warmup")  # 4 prompts an engine
        if control is not None:
            control.run(warmup_batch(1, vocab), "warmup")
        names = ["cluster", "bare"] + (["control"] if control is not None else [])
        pairs = []
        for s, seed in enumerate(seeds):
            for r in range(args.rounds):
                if only is not None and (seed, r) not in only:
                    continue
                order = round_order(names, r + s)
                pair = {"seed": seed, "round": r, "order": order}
                for who in order:
                    reqs, _ = workload(args, seed, vocab, ids_salt=f"-{who}-r{r}")
                    if who == "cluster":
                        t0 = time.monotonic()
                        done = client.run_requests(reqs, timeout_s=args.timeout_s)
                        pair[who] = summary(time.monotonic() - t0, [c.finish_time_s for c in done],
                                            sum(len(c.token_ids) for c in done))
                    else:
                        res = (bare if who == "bare" else control).run(reqs, f"{who}-s{seed}r{r}")
                        pair[who] = summary(res["makespan_s"], res["finish_times"], res["tokens"])
                pair["overhead_pct"] = pct_over(pair["cluster"], pair["bare"])
                if control is not None:
                    pair["control_pct"] = pct_over(pair["control"], pair["bare"])
                    pair["vs_both_pct"] = pct_over_both(pair)
                print(json.dumps(pair), flush=True)
                pairs.append(pair)
    finally:
        client.shutdown()
        bare.close()
        if control is not None:
            control.close()
    result = combine(pairs, cfg, args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(result, indent=1))
    (out / "overhead.md").write_text(table(result))
    print(table(result))
    return result


def pct_over(run: dict, base: dict) -> float:
    """How much longer `run` took than `base`, in percent."""
    return round(100 * (run["makespan_s"] / base["makespan_s"] - 1), 2)


def pct_over_both(pair: dict) -> float:
    """The cluster against the mean of both bare engines' makespans in its round, in percent:
    neither bare engine is the reference (their own difference is the control's)."""
    both = {"makespan_s": 0.5 * (pair["bare"]["makespan_s"] + pair["control"]["makespan_s"])}
    return pct_over(pair["cluster"], both)


def summary(makespan: float, finish_times: list, tokens: int) -> dict:
    return {"makespan_s": round(makespan, 3), "median_finish_s": round(percentile(finish_times, 0.5), 3),
            "tail_s": round(tail_s(finish_times), 3), "tokens": tokens}


def combine(pairs: list, cfg, args) -> dict:
    pct = [p["overhead_pct"] for p in pairs]
    seeds = sorted({p["seed"] for p in pairs})
    return {"config": args.config, "model": cfg.engine.model, "replicas": cfg.replicas, "policy": cfg.policy.name,
            "max_num_seqs": cfg.engine.max_num_seqs,
            "max_num_batched_tokens": cfg.engine.max_num_batched_tokens, "memory_fraction": args.memory_fraction,
            "workload": {k: getattr(args, k) for k in ("prompts", "samples", "median", "sigma_prompt",
                                                        "sigma_sample", "max_tokens", "prompt_min", "prompt_max")},
            "rounds": args.rounds, "pairs": pairs,
            "median_overhead_pct": round(median(pct), 2), "min_pct": min(pct), "max_pct": max(pct),
            "per_seed_median_pct": {s: round(median([p["overhead_pct"] for p in pairs if p["seed"] == s]), 2)
                                    for s in seeds},
            **control_stats(pairs)}


def control_stats(pairs: list) -> dict:
    """The second bare engine against the first (empty without --control)."""
    pct = [p["control_pct"] for p in pairs if "control_pct" in p]
    if not pct:
        return {}
    both = [pct_over_both(p) for p in pairs if "control" in p]
    return {"control_median_pct": round(median(pct), 2), "control_min_pct": min(pct), "control_max_pct": max(pct),
            "vs_both_median_pct": round(median(both), 2), "vs_both_min_pct": min(both), "vs_both_max_pct": max(both)}


def table(result: dict) -> str:
    control = "control_median_pct" in result
    head = "| seed | round | order | cluster (s) | bare (s) | overhead |"
    head += " control (s) | control vs bare |" if control else ""
    rows = [head + " median finish, cluster / bare (s) |", "|---:|---:|---|---:|---:|---:|" + ("---:|---:|" if control else "")
            + "---|"]
    for p in result["pairs"]:
        c, b = p["cluster"], p["bare"]
        row = (f"| {p['seed']} | {p['round']} | {' then '.join(p['order'])} | {c['makespan_s']:.2f} | "
               f"{b['makespan_s']:.2f} | {p['overhead_pct']:+.2f} % |")
        if control:
            row += f" {p['control']['makespan_s']:.2f} | {p['control_pct']:+.2f} % |"
        rows.append(row + f" {c['median_finish_s']:.2f} / {b['median_finish_s']:.2f} |")
    rows.append("")
    if result.get("replicas", 1) > 1:
        rows.append(f"the cluster: {result['replicas']} replicas, policy {result['policy']}; bare: "
                    f"{result['replicas']} engines, each a contiguous share of the prompts (the slowest one's time)")
    rows.append(f"median paired overhead {result['median_overhead_pct']:+.2f} % (spread {result['min_pct']:+.2f} "
                f"to {result['max_pct']:+.2f} %); per seed: "
                + ", ".join(f"{s}: {v:+.2f} %" for s, v in result["per_seed_median_pct"].items()))
    if control:
        rows.append(f"control (a second bare engine, started last) against the first: median "
                    f"{result['control_median_pct']:+.2f} % (spread {result['control_min_pct']:+.2f} to "
                    f"{result['control_max_pct']:+.2f} %)")
        rows.append(f"cluster against the mean of both bare engines, round by round: median "
                    f"{result['vs_both_median_pct']:+.2f} % (spread {result['vs_both_min_pct']:+.2f} to "
                    f"{result['vs_both_max_pct']:+.2f} %)")
    return "\n".join(rows) + "\n"


def split_by_prompt(requests: list, engines: int) -> list:
    """The requests in `engines` lists, as an offline data-parallel job splits a batch: contiguous
    shares of the prompts (in order of first appearance), every sample of a prompt in one share,
    the shares' prompt counts differing by at most one."""
    prompts = list(dict.fromkeys(r.prompt_index for r in requests))
    share = {p: i * engines // len(prompts) for i, p in enumerate(prompts)} if prompts else {}
    out: list = [[] for _ in range(engines)]
    for r in requests:
        out[share[r.prompt_index]].append(r)
    return out


def merge_runs(answers: list) -> dict:
    """Bare engines that ran their shares at once, as one run: the slowest one's makespan, every
    sequence's finish time (each from its own engine's start), every token."""
    return {"makespan_s": max(a["makespan_s"] for a in answers), "tokens": sum(a["tokens"] for a in answers),
            "finish_times": [t for a in answers for t in a["finish_times"]]}


class BareEngine:
    """One bare AsyncLLM in a spawned process that runs batch after batch on request; `rank`
    places it as the cluster places replica `rank` (engines/engine_env.py)."""

    def __init__(self, cfg, name: str = "bare", rank: int = 0):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve_main, args=(cfg.engine, cfg.model_path(), child, name, rank))
        self.proc.start()
        ready = self.conn.recv()
        if ready != "ready":
            raise RuntimeError(f"bare engine failed to start: {ready}")

    def start(self, requests: list, tag: str) -> None:
        self.conn.send((tag, requests))

    def wait(self) -> dict:
        answer = self.conn.recv()
        if isinstance(answer, str):
            raise RuntimeError(f"bare engine: {answer}")
        return answer

    def run(self, requests: list, tag: str) -> dict:
        self.start(requests, tag)
        return self.wait()

    def close(self) -> None:
        try:
            self.conn.send(None)
            self.proc.join(timeout=60)
        finally:
            if self.proc.is_alive():
                self.proc.terminate()


class BareEngines:
    """`n` bare engines (ranks 0..n-1) that run a batch together, split by split_by_prompt."""

    def __init__(self, cfg, n: int):
        self.engines: list = []
        try:
            for rank in range(n):
                self.engines.append(BareEngine(cfg, "bare" if n == 1 else f"bare{rank}", rank))
        except BaseException:
            self.close()
            raise

    def run(self, requests: list, tag: str) -> dict:
        shares = split_by_prompt(requests, len(self.engines))
        for i, (engine, share) in enumerate(zip(self.engines, shares)):
            engine.start(share, tag if len(self.engines) == 1 else f"{tag}-e{i}")
        return merge_runs([engine.wait() for engine in self.engines])

    def close(self) -> None:
        for engine in self.engines:
            engine.close()


def _serve_main(engine_cfg, model: str, conn, name: str, rank: int = 0) -> None:
    try:
        asyncio.run(_serve(engine_cfg, model, conn, name, rank))
    except BaseException as e:  # noqa: BLE001  (the parent must hear of any failure)
        conn.send(f"{type(e).__name__}: {e}")
    os._exit(0)


async def _serve(engine_cfg, model: str, conn, name: str, rank: int = 0) -> None:
    from vllm.v1.engine.async_llm import AsyncLLM

    from ..engines.engine_env import apply_engine_env
    from ..engines.vllm_engine import engine_args, is_cpu_build
    from ..serve.timeline import Timeline

    apply_engine_env(engine_cfg, rank, is_cpu_build())  # replica `rank`'s core on a CPU; its threads on a GPU
    engine = AsyncLLM.from_engine_args(engine_args(engine_cfg, model))
    timeline = Timeline.from_env(name)
    if timeline is not None:
        timeline.start_probe()
    loop = asyncio.get_running_loop()
    conn.send("ready")
    try:
        while (msg := await loop.run_in_executor(None, conn.recv)) is not None:
            tag, requests = msg
            t0 = time.monotonic()
            done = await all_in_flight(engine, requests, tag)
            conn.send({"makespan_s": time.monotonic() - t0, "tokens": sum(n for n, _ in done),
                       "finish_times": [t - t0 for _, t in done]})
    finally:
        if timeline is not None:
            timeline.close()
        engine.shutdown()
