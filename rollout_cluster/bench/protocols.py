"""`rollout-cluster protocol-overhead`: one batch through TRL's /generate/, OpenAI's /v1/completions and
RolloutClient.generate, side by side on one running cluster.

The same batch shape goes down each path: `--prompts` prompts of fresh random token ids (no run
finds another's prefix cache) x `--samples` samples, `--max-tokens` each with ignore_eos, so every
path decodes the same number of tokens. Paths take turns in an order that rotates from round to
round; the answer is each HTTP path's median over rounds of (its makespan / the driver's makespan
in the same round - 1). The HTTP paths are plain JSON over urllib with the app's bearer token: what
is measured is the Gateway (parsing, auth, the batch follow, the answer's JSON), not a client library.
"""
from __future__ import annotations

import json
import os
import random
import time
import urllib.request

from ..config import load_config
from ..protocol import SamplingSpec
from .report import save_result
from .repeats import median

PATHS = ("driver", "trl_generate", "openai_completions")


def random_prompts(rng: random.Random, vocab: int, count: int, low: int = 16, high: int = 48) -> list:
    """`count` prompts of random token ids (3..vocab-1: clear of the tokenizer's specials)."""
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


class Gateway:
    """POST JSON to the app's HTTP routes with its bearer token."""

    def __init__(self, cfg):
        from ..security.secrets import read_token

        port = int(os.environ.get("ROLLOUT_HTTP_PORT", 8000))
        self.base = f"http://127.0.0.1:{port}/{cfg.app_name}"
        self.headers = {"Authorization": f"Bearer {read_token(cfg.security)}", "Content-Type": "application/json"}

    def post(self, path: str, body: dict, timeout_s: float, headers: dict | None = None) -> dict:
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(), method="POST",
                                     headers={**self.headers, **(headers or {})})
        with urllib.request.urlopen(req, timeout=timeout_s) as answer:
            return json.loads(answer.read())


def run_path(path: str, client, gateway: Gateway, prompts: list, n: int, max_tokens: int, timeout_s: float) -> tuple:
    """(seconds, tokens per sequence) of one batch down `path`."""
    t0 = time.monotonic()
    if path == "driver":
        done = client.generate(prompts, SamplingSpec(n=n, max_tokens=max_tokens, ignore_eos=True, logprobs=0),
                               timeout_s=timeout_s)
        lengths = [len(c.token_ids) for c in done]
    elif path == "trl_generate":
        body = gateway.post("/generate/", {"prompts": prompts, "n": n, "max_tokens": max_tokens, "logprobs": 0,
                                           "generation_kwargs": {"ignore_eos": True}}, timeout_s)
        lengths = [len(ids) for ids in body["completion_ids"]]
    else:
        body = gateway.post("/v1/completions", {"prompt": prompts, "n": n, "max_tokens": max_tokens, "logprobs": 0,
                                                "ignore_eos": True, "return_token_ids": True}, timeout_s)
        lengths = [len(c["token_ids"]) for c in body["choices"]]
    seconds = time.monotonic() - t0
    if lengths != [max_tokens] * (len(prompts) * n):
        raise RuntimeError(f"{path}: expected {len(prompts) * n} sequences of {max_tokens} tokens, got {lengths[:8]}...")
    return seconds, lengths


def protocol_overhead(args) -> dict:
    from ..client.client import RolloutClient

    cfg = load_config(args.config)
    client = RolloutClient.start(cfg)
    try:
        gateway = Gateway(client.config)  # (start made the token and points its config at it)
        vocab = int(client.status()["model"]["vocab_size"])
        rng = random.Random(args.seed)
        for path in PATHS:  # warm-up: each path's first call pays imports and connection setup
            run_path(path, client, gateway, random_prompts(rng, vocab, 2), 2, 4, args.timeout_s)
        rounds = []
        for r in range(args.rounds):
            order = PATHS[r % 3:] + PATHS[:r % 3]
            row = {"round": r, "order": list(order)}
            for path in order:
                row[path] = run_path(path, client, gateway, random_prompts(rng, vocab, args.prompts), args.samples,
                                     args.max_tokens, args.timeout_s)[0]
            rounds.append(row)
            print(f"round {r}: " + ", ".join(f"{p} {row[p]:.2f} s" for p in PATHS), flush=True)
    finally:
        client.shutdown()
    result = {"config": args.config, "prompts": args.prompts, "samples": args.samples, "max_tokens": args.max_tokens,
              "rounds": rounds, "median_s": {p: median([row[p] for row in rounds]) for p in PATHS}}
    result["overhead_pct"] = {p: round(100 * median([row[p] / row["driver"] - 1 for row in rounds]), 2)
                              for p in PATHS[1:]}
    lines = [f"# Protocol overhead: {args.prompts} prompts x {args.samples} samples x {args.max_tokens} tokens, "
             f"{args.rounds} rounds", "", "| path | median makespan (s) | median paired overhead vs driver |",
             "|---|---|---|"]
    for p in PATHS:
        over = "-" if p == "driver" else f"{result['overhead_pct'][p]:+.2f} %"
        lines.append(f"| {p} | {result['median_s'][p]:.2f} | {over} |")
    save_result(args.out, "protocols", result, lines)
    return result
