"""GRPO on the rollout cluster: a small Llama learns to reverse digit strings.

    python examples/grpo/train.py --config configs/local-cpu.yaml --steps 100 --out out/grpo

Starts the cluster of --config (or, with --app-name, attaches to one that runs), makes a policy of
the served model's architecture, warms it up with a short supervised run, syncs it to the
engines, then per step: rollouts (n samples a prompt, partial rollouts carried to the next step),
rewards, one clipped policy-gradient update in this process, and a weight sync. Writes
metrics.jsonl (one line a step), summary.json and grpo.png into --out.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the example's own modules

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from groups import GroupBuffer  # noqa: E402
from loss import clipped_pg_loss, group_advantages  # noqa: E402
from plot import plot_run  # noqa: E402
from policy import make_policy, response_logprobs, warm_start  # noqa: E402
from sync import MODES, WeightSync, compare  # noqa: E402
from task import EOS, Task, exact, reward  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/local-cpu.yaml", help="the cluster's config")
    p.add_argument("--steps", type=int, default=100, help="GRPO steps")
    p.add_argument("--out", required=True, help="folder for metrics.jsonl, summary.json, grpo.png")
    p.add_argument("--app-name", default=None, help="attach to this running app instead of starting one")
    p.add_argument("--address", default=None, help="Ray address (with --app-name: default auto)")
    p.add_argument("--sync", default="push", choices=MODES, help="how weights reach the engines")
    p.add_argument("--checkpoint-dir", default=None,
                   help="where --sync checkpoint (and --compare-sync) write checkpoints; under "
                        "security.checkpoint_roots (default: <last root>/grpo)")
    p.add_argument("--compare-sync", type=int, default=0, metavar="R",
                   help="at the end, time both syncs on the final weights, R times each")
    p.add_argument("--prompts", type=int, default=32, help="new prompts a step")
    p.add_argument("--n", type=int, default=8, help="samples a prompt (the GRPO group)")
    p.add_argument("--finish-fraction", type=float, default=0.9, help="cut each batch there (1.0: no cut)")
    p.add_argument("--finish-by", default="group", choices=("sample", "group"))
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--updates", type=int, default=2, help="optimizer steps a batch (minibatches)")
    p.add_argument("--clip", type=float, default=0.2, help="PPO ratio clip")
    p.add_argument("--warm-steps", type=int, default=80, help="supervised warm-start steps (batch 64)")
    p.add_argument("--warm-lr", type=float, default=3e-3)
    p.add_argument("--min-digits", type=int, default=2)
    p.add_argument("--max-digits", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="torch threads of the trainer")
    p.add_argument("--time-limit-s", type=float, default=None, help="stop stepping once the run is this old")
    args = p.parse_args(argv)
    # Values that would run without learning or crash later, refused by name now (GRPO's advantage
    # is relative to the prompt's group: a group of one gives every sample 0, so the loss is 0)
    rules = [("--n", args.n >= 2, "at least 2 samples a prompt (the GRPO group)"),
             ("--steps", args.steps >= 1, "at least 1"), ("--prompts", args.prompts >= 1, "at least 1"),
             ("--updates", args.updates >= 1, "at least 1"), ("--threads", args.threads >= 1, "at least 1"),
             ("--finish-fraction", 0 < args.finish_fraction <= 1, "in (0, 1]"),
             ("--lr", args.lr > 0, "above 0"), ("--warm-lr", args.warm_lr > 0, "above 0"),
             ("--clip", args.clip > 0, "above 0"), ("--warm-steps", args.warm_steps >= 0, "0 or more"),
             ("--compare-sync", args.compare_sync >= 0, "0 or more"),
             ("--min-digits", 1 <= args.min_digits <= args.max_digits, "at least 1 and at most --max-digits")]
    for flag, ok, rule in rules:
        if not ok:
            p.error(f"{flag}={getattr(args, flag[2:].replace('-', '_'))}: must be {rule}")
    return args


def connect(args, cfg):
    from rollout_cluster import RolloutClient
    from rollout_cluster.security.local import ensure_local_secrets

    ensure_local_secrets(cfg)
    if args.app_name:
        return RolloutClient.connect(args.app_name, address=args.address or "auto", config=cfg)
    return RolloutClient.start(cfg, address=args.address)


def train_step(model, opt, samples, version: int, args) -> dict:
    """One clipped policy-gradient update over `samples` (args.updates minibatches). Also measures
    how far the trainer's logprobs are from the engines' on tokens sampled with the weights the
    trainer holds now: the engines run exactly these weights when that is ~1e-5."""
    order = list(range(len(samples)))
    random.Random(version).shuffle(order)
    stats, mismatch = [], 0.0
    model.train()
    for u in range(args.updates):
        part = [samples[i] for i in order[u::args.updates]]
        if not part:
            continue
        logp, mask = response_logprobs(model, [s.prompt for s in part], [s.tokens for s in part])
        old = torch.stack([F.pad(torch.tensor(s.logprobs), (0, logp.shape[1] - len(s.logprobs))) for s in part])
        if u == 0:  # the weights the engines ran with: every token after the resumed ones came from them
            fresh = torch.zeros_like(mask)
            for i, s in enumerate(part):
                if s.weights_version == version:
                    fresh[i, s.resumed_tokens:len(s.tokens)] = 1
            if fresh.sum():
                mismatch = float(((logp.detach() - old).abs() * fresh).max())
        adv = torch.tensor([s.advantage for s in part], dtype=torch.float32)
        loss, st = clipped_pg_loss(logp, old, adv, mask, args.clip)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        stats.append({"loss": loss.item(), **st})
    return {k: statistics.fmean(s[k] for s in stats) for k in stats[0]} | {"logprob_mismatch": mismatch}


def run(client, args, cfg) -> dict:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    from rollout_cluster import SamplingSpec

    t_start = time.perf_counter()
    task = Task(args.min_digits, args.max_digits)
    model = make_policy(cfg.model_path(), args.seed)
    t0 = time.perf_counter()
    warm_losses = warm_start(model, task, args.warm_steps, lr=args.warm_lr, seed=args.seed)
    warm_s = time.perf_counter() - t0
    ckpt = Path(args.checkpoint_dir or Path(cfg.security.checkpoint_roots[-1]) / "grpo")
    sync = WeightSync(client, args.sync, ckpt)
    first = sync(model)  # the engines serve the warmed-up policy from step 0 on
    version = first.version
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    spec = SamplingSpec(n=args.n, max_tokens=task.max_response_tokens, temperature=1.0, logprobs=0,
                        stop_token_ids=(EOS,))
    rng = random.Random(args.seed + 1)
    buffer = GroupBuffer(args.n)
    metrics = []
    with open(out / "metrics.jsonl", "w") as log:
        for step in range(args.steps):
            if args.time_limit_s and time.perf_counter() - t_start > args.time_limit_s:
                break
            items = buffer.batch(task.prompts(rng, args.prompts), step)
            t0 = time.perf_counter()
            results = client.generate(items, spec, weights_version=version, finish_fraction=args.finish_fraction,
                                      finish_by=args.finish_by)
            t1 = time.perf_counter()
            groups, bstats = buffer.take(items, results)
            samples = [s for g in groups for s in g.samples]
            for g in groups:
                for s in g.samples:
                    s.reward = reward(s.prompt, s.tokens)
                for s, a in zip(g.samples, group_advantages([s.reward for s in g.samples])):
                    s.advantage = a
            t2 = time.perf_counter()
            tstats = train_step(model, opt, samples, version, args) if samples else {}
            t3 = time.perf_counter()
            synced = sync(model)
            t4 = time.perf_counter()
            row = {"step": step, "weights_version": version, "next_version": synced.version,
                   "rollout_versions": sorted({c.weights_version for c in results}),
                   "reward": statistics.fmean(s.reward for s in samples) if samples else None,
                   "exact": statistics.fmean(exact(s.prompt, s.tokens) for s in samples) if samples else None,
                   "groups": len(groups), "samples": len(samples),
                   "response_tokens": statistics.fmean(len(s.tokens) for s in samples) if samples else None,
                   "time_s": {"rollout": t1 - t0, "reward": t2 - t1, "train": t3 - t2, "sync": t4 - t3},
                   "sync": asdict(synced), "batch": asdict(bstats), **tstats}
            metrics.append(row)
            log.write(json.dumps(row) + "\n")
            log.flush()
            print(f"step {step:3d} v{version} reward {row['reward'] or 0:.3f} exact {row['exact'] or 0:.3f} "
                  f"groups {len(groups)} cut {bstats.cut} resumed {bstats.resumed} | rollout {t1 - t0:.2f}s "
                  f"train {t3 - t2:.2f}s sync {t4 - t3:.2f}s | mismatch {tstats.get('logprob_mismatch', 0):.1e}",
                  flush=True)
            version = synced.version
    compared = compare(client, model, ckpt, args.compare_sync) if args.compare_sync else None
    summary = summarize(args, metrics, warm_losses, warm_s, first, compared, time.perf_counter() - t_start)
    summary["partials"]["carried_at_end"] = buffer.pending()
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(plot_run(metrics, out / "grpo.png", f"GRPO, reverse digits: {len(metrics)} steps, {args.prompts} prompts x "
                   f"{args.n} samples, cut at {args.finish_fraction} by {args.finish_by}, sync by {args.sync}"))
    return summary


def summarize(args, metrics, warm_losses, warm_s, first, compared, wall_s) -> dict:
    rewards = [m["reward"] for m in metrics if m["reward"] is not None]
    k = max(1, min(5, len(rewards) // 4))

    def mean_time(part):
        return statistics.fmean(m["time_s"][part] for m in metrics) if metrics else None

    def sync_stats(timings):
        if timings is None:
            return "not available: RolloutClient has no push_weights in this version"
        totals = [t.total_s for t in timings]
        return {"median_total_s": statistics.median(totals), "min_total_s": min(totals),
                "median_save_s": statistics.median(t.save_s for t in timings),
                "median_load_s": statistics.median(t.load_s for t in timings), "repeats": len(timings)}

    return {
        "args": vars(args), "steps": len(metrics), "wall_s": wall_s,
        "warm_start": {"steps": len(warm_losses), "seconds": warm_s,
                       "loss_first": warm_losses[0] if warm_losses else None,
                       "loss_last": warm_losses[-1] if warm_losses else None},
        "first_sync": asdict(first),
        "reward_first_step": rewards[0] if rewards else None, "reward_last_step": rewards[-1] if rewards else None,
        f"reward_first_{k}_mean": statistics.fmean(rewards[:k]) if rewards else None,
        f"reward_last_{k}_mean": statistics.fmean(rewards[-k:]) if rewards else None,
        "exact_first_step": metrics[0]["exact"] if metrics else None,
        "exact_last_step": metrics[-1]["exact"] if metrics else None,
        "mean_step_time_s": {p: mean_time(p) for p in ("rollout", "reward", "train", "sync")},
        "max_logprob_mismatch": max((m.get("logprob_mismatch", 0.0) for m in metrics), default=None),
        "partials": {"cut": sum(m["batch"]["cut"] for m in metrics),
                     "resumed": sum(m["batch"]["resumed"] for m in metrics)},
        "sync_compare": None if compared is None else {mode: sync_stats(t) for mode, t in compared.items()},
    }


def main(argv=None) -> int:
    from rollout_cluster import load_config

    args = parse_args(argv)
    cfg = load_config(args.config)
    client = connect(args, cfg)
    try:
        summary = run(client, args, cfg)
    finally:
        if not args.app_name:
            client.shutdown()
    print(json.dumps({k: v for k, v in summary.items() if k != "args"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
