"""`rollout-cluster multiturn`: the prefix-cache hit rate of multi-turn sessions with and without
session affinity, on one running cluster (router/sessions.py).

A session of `--turns` turns: turn 1's prompt is random token ids; turn t+1's prompt is turn t's
prompt + its response + `--user-tokens` new ones, as an agent's conversation grows. All
`--sessions` sessions run each turn together, as one batch. With affinity every request carries
its session id; without, none does. The hit rate of a turn is the prompt tokens the engines found
in their prefix cache over the prompt tokens they were given (vLLM's num_cached_tokens, summed by
the router: status()["counters"]); the best a turn can do is its previous context over its prompt
(less vLLM's partial last block: 16 tokens on GPUs, 128 on vLLM-CPU). The sessions come back in
a shuffled order every turn, as agents do. Runs alternate between the two modes with fresh token ids
each, and every engine drops its prefix cache before each run.
"""
from __future__ import annotations

import random
import time

from ..config import load_config
from ..protocol import SamplingSpec
from .protocols import random_prompts
from .report import save_result
from .repeats import median

MODES = ("affinity", "none")


def counters(client) -> tuple:
    c = client.status()["counters"]
    return c["prompt_tokens_measured"], c["prompt_cached_tokens"]


def run_sessions(client, mode: str, rng: random.Random, vocab: int, args, run: int) -> list:
    """One run of every session's turns; per turn: hit rate, best possible, makespan."""
    client.reset_prefix_cache()
    time.sleep(1.0)  # the replicas take the order at their next pull
    prompts = random_prompts(rng, vocab, args.sessions, args.user_tokens, args.user_tokens)
    ids = [f"run{run}-s{i}" for i in range(args.sessions)] if mode == "affinity" else None
    spec = SamplingSpec(max_tokens=args.response_tokens, ignore_eos=True)
    turns = []
    for t in range(args.turns):
        # Agents come back in another order every turn (their tools and rewards take different
        # times): without affinity, where a turn lands is then up to the queue, not the session.
        order = list(range(args.sessions))
        rng.shuffle(order)
        before = counters(client)
        t0 = time.monotonic()
        shuffled = client.generate([prompts[i] for i in order], spec,
                                   sessions=None if ids is None else [ids[i] for i in order], timeout_s=args.timeout_s)
        seconds = time.monotonic() - t0
        done = [None] * args.sessions
        for i, c in zip(order, shuffled):
            done[i] = c
        measured, cached = (a - b for a, b in zip(counters(client), before))
        total = sum(len(p) for p in prompts)
        best = 0 if t == 0 else sum(len(p) - args.user_tokens for p in prompts)
        turns.append({"turn": t + 1, "prompt_tokens": total, "measured": measured, "cached": cached,
                      "hit_rate": cached / measured if measured else 0.0, "best": best / total,
                      "makespan_s": round(seconds, 3)})
        prompts = [p + list(c.token_ids) + [rng.randrange(3, vocab) for _ in range(args.user_tokens)]
                   for p, c in zip(prompts, done)]
    return turns


def multiturn(args) -> dict:
    from ..client.client import RolloutClient

    cfg = load_config(args.config)
    client = RolloutClient.start(cfg)
    try:
        vocab = int(client.status()["model"]["vocab_size"])
        rng = random.Random(args.seed)
        runs = []
        for r in range(args.rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                turns = run_sessions(client, mode, rng, vocab, args, len(runs))
                runs.append({"round": r, "mode": mode, "turns": turns})
                later = turns[1:]
                print(f"round {r} {mode}: hit rate of turns 2..{args.turns} "
                      f"{sum(t['cached'] for t in later) / max(1, sum(t['measured'] for t in later)):.3f} "
                      f"(best {median([t['best'] for t in later]):.3f})", flush=True)
        sessions = client.status()["sessions"]
    finally:
        client.shutdown()
    summary = {}
    for mode in MODES:
        later = [t for run in runs if run["mode"] == mode for t in run["turns"][1:]]
        summary[mode] = {"hit_rate": round(sum(t["cached"] for t in later) / max(1, sum(t["measured"] for t in later)), 4),
                         "best": round(sum(t["best"] * t["prompt_tokens"] for t in later)
                                       / max(1, sum(t["prompt_tokens"] for t in later)), 4),
                         "median_turn_s": median([t["makespan_s"] for t in later])}
    result = {"config": args.config, "sessions": args.sessions, "turns": args.turns,
              "user_tokens": args.user_tokens, "response_tokens": args.response_tokens, "rounds": args.rounds,
              "summary": summary, "router_sessions": sessions, "runs": runs}
    lines = [f"# Multi-turn prefix-cache hits: {args.sessions} sessions x {args.turns} turns "
             f"(+{args.user_tokens} user, {args.response_tokens} response tokens a turn), {args.rounds} rounds",
             "", "| mode | hit rate, turns 2.. | best possible | median turn makespan (s) |", "|---|---|---|---|"]
    for mode in MODES:
        s = summary[mode]
        lines.append(f"| {mode} | {s['hit_rate']:.3f} | {s['best']:.3f} | {s['median_turn_s']:.2f} |")
    save_result(args.out, "multiturn", result, lines)
    return result
