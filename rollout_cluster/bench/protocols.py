"""`rollout-cluster protocol-overhead`: one batch through TRL's /generate/, OpenAI's /v1/completions and
RolloutClient.generate, side by side on one running cluster.

The same batch shape goes down each path: `--prompts` prompts of fresh random token ids (no run
finds another's prefix cache) x `--samples` samples, `--max-tokens` each with ignore_eos, so every
path decodes the same number of tokens. Paths take turns in an order that rotates from round to
round; the answer is each HTTP path's median over rounds of (its makespan / the driver's makespan
in the same round - 1). The HTTP paths are plain JSON over urllib with the app's bearer token: what
is measured is the Gateway (parsing, auth, the batch follow, the answer's JSON), not a client library.
Each batch's life is timed phase by phase too (`life`): the Gateway writes its side to
ROLLOUT_GATEWAY_TIMELINE_DIR (serve/call_timeline.py; default <out>/timeline), the driver's router
calls are timed in-process; the second answer, the same pairs outside the engines' span, comes from it.
"""
from __future__ import annotations

import gc
import json
import os
import random
import time
import urllib.request

from ..config import load_config
from ..protocol import SamplingSpec
from ..serve.call_timeline import ENV as TIMELINE_ENV, TRACE_HEADER, CallTimeline, TimedRouter, current_label
from .report import save_result
from .repeats import median

PATHS = ("driver", "trl_generate", "openai_completions")
# A pause before each batch, so that every path starts on engines that finished the last batch's
# work: each path's batch would otherwise start as soon after the one before as that path's tail allows.
SETTLE_S = 0.5


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

    def post(self, path: str, body: dict, timeout_s: float, headers: dict | None = None,
             marks: dict | None = None) -> dict:
        """The answer's JSON; `marks` gets the client's times (sent, headers, body, decoded)."""
        marks = {} if marks is None else marks
        marks["sent"] = time.monotonic()
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(), method="POST",
                                     headers={**self.headers, **(headers or {})})
        with urllib.request.urlopen(req, timeout=timeout_s) as answer:
            marks["headers"] = time.monotonic()
            raw = answer.read()
        marks["body"] = time.monotonic()
        out = json.loads(raw)
        marks["decoded"], marks["bytes"] = time.monotonic(), len(raw)
        return out


def run_path(path: str, client, gateway: Gateway, prompts: list, n: int, max_tokens: int, timeout_s: float,
             label: str = "", marks: dict | None = None) -> tuple:
    """(seconds, tokens per sequence) of one batch down `path`. `label` names it in the Gateway's
    timeline (call_timeline.py); `marks` gets the client's times."""
    marks = {} if marks is None else marks
    headers = {TRACE_HEADER: label} if label else None
    t0 = time.monotonic()
    if path == "driver":
        marks["sent"] = t0
        token = current_label.set(label)
        try:
            done = client.generate(prompts, SamplingSpec(n=n, max_tokens=max_tokens, ignore_eos=True, logprobs=0),
                                   timeout_s=timeout_s)
        finally:
            current_label.reset(token)
        marks["decoded"] = time.monotonic()
        lengths = [len(c.token_ids) for c in done]
    elif path == "trl_generate":
        body = gateway.post("/generate/", {"prompts": prompts, "n": n, "max_tokens": max_tokens, "logprobs": 0,
                                           "generation_kwargs": {"ignore_eos": True}}, timeout_s, headers, marks)
        lengths = [len(ids) for ids in body["completion_ids"]]
    else:
        body = gateway.post("/v1/completions", {"prompt": prompts, "n": n, "max_tokens": max_tokens, "logprobs": 0,
                                                "ignore_eos": True, "return_token_ids": True}, timeout_s, headers,
                            marks)
        lengths = [len(c["token_ids"]) for c in body["choices"]]
    seconds = time.monotonic() - t0
    if lengths != [max_tokens] * (len(prompts) * n):
        raise RuntimeError(f"{path}: expected {len(prompts) * n} sequences of {max_tokens} tokens, got {lengths[:8]}...")
    return seconds, lengths


# A batch's life: the marks in order, each phase named by the mark that ends it. The Gateway's
# marks are absent on the driver's path, whose "decode" is then from the last fetch to generate's return.
MARKS = (("sent", None), ("received", "in"), ("submit_sent", "prepare"), ("submitted", "submit"),
         ("router_done", "generate"), ("last_fetch", "follow_tail"), ("answered", "build"), ("headers", "out"),
         ("body", "body"), ("decoded", "decode"))


def life(marks: dict, calls: list) -> dict:
    """Seconds per phase of one batch (MARKS) from the client's marks and the router calls' lines
    (each {"kind", "t", "sent", ...}); "router_done" is when the router saw the batch's last
    sequence end (its submission + the latest finish_time_s)."""
    at = dict(marks)
    for line in calls:
        if line["kind"] in ("received", "answered"):
            at[line["kind"]] = line["t"]
    submits = [c for c in calls if c["kind"] == "submit_batch"]
    fetches = [c for c in calls if c["kind"] == "fetch"]
    if submits and fetches:
        at["submit_sent"], at["submitted"] = submits[0]["sent"], submits[0]["t"]
        finish = max((c["last_finish_s"] for c in fetches if c["last_finish_s"] is not None), default=0.0)
        at["router_done"] = submits[0]["sent"] + finish
        at["last_fetch"] = fetches[-1]["t"]
    out, previous = {}, None
    for mark, phase in MARKS:
        if mark in at:
            if previous is not None:
                out[phase] = round(at[mark] - at[previous], 4)
            previous = mark
    out["fetches"] = len(fetches)
    out["total"] = round(at["decoded"] - at["sent"], 4)
    for name, seconds in (marks.get("cpu") or {}).items():
        out[f"cpu_{name}"] = round(seconds, 4)
    return out


# The processes whose CPU time a batch's life counts (by a part of their command line)
CPU_OF = {"gateway": "ServeReplica:rollout:Gateway", "proxy": "ProxyActor", "router": "ServeReplica:rollout:Router",
          "engines": "ServeReplica:rollout:EngineReplica"}


def cpu_seconds() -> dict:
    """User + system CPU seconds so far of the bench itself and of CPU_OF's processes (with
    their children: an engine replica's EngineCore and workers)."""
    import psutil

    out = {"bench": sum(os.times()[:2])}
    for proc in psutil.process_iter(["cmdline"]):
        line = " ".join(proc.info["cmdline"] or [])
        for name, part in CPU_OF.items():
            if part in line:
                try:
                    tree = [proc] + proc.children(recursive=True)
                    out[name] = out.get(name, 0.0) + sum(sum(p.cpu_times()[:2]) for p in tree)
                except psutil.Error:
                    pass
    return out


def protocol_overhead(args) -> dict:
    from ..client.client import RolloutClient

    cfg = load_config(args.config)
    # the Gateway (started below, under this environment) writes its timeline there
    folder = os.environ[TIMELINE_ENV] = os.path.abspath(os.environ.get(TIMELINE_ENV) or os.path.join(args.out, "timeline"))
    os.makedirs(folder, exist_ok=True)
    if os.path.exists(os.path.join(folder, "gateway.jsonl")):
        os.remove(os.path.join(folder, "gateway.jsonl"))
    client = RolloutClient.start(cfg)
    driver_calls: list = []  # the driver's router calls, timed as the Gateway times its own
    client.router = TimedRouter(client.router, CallTimeline(sink=driver_calls.append))
    try:
        gateway = Gateway(client.config)  # (start made the token and points its config at it)
        vocab = int(client.status()["model"]["vocab_size"])
        rng = random.Random(args.seed)
        for path in PATHS:  # warm-up: each path's first call pays imports and connection setup
            run_path(path, client, gateway, random_prompts(rng, vocab, 2), 2, 4, args.timeout_s)
        # This process's heap (Ray, the client) out of the collector's way: else every few batches a
        # full collection, set off by the 16k small lists of TRL's answer, walks it (~100 ms) inside
        # the HTTP path's time. What is measured is the path, not this process's heap.
        gc.collect()
        gc.freeze()
        rounds = []
        for r in range(args.rounds):
            order = PATHS[r % 3:] + PATHS[:r % 3]
            row, marks = {"round": r, "order": list(order)}, {}
            for path in order:
                time.sleep(SETTLE_S)
                marks[path], cpu0 = {}, cpu_seconds()
                row[path] = run_path(path, client, gateway, random_prompts(rng, vocab, args.prompts), args.samples,
                                     args.max_tokens, args.timeout_s, f"r{r}-{path}", marks[path])[0]
                marks[path]["cpu"] = {k: v - cpu0.get(k, 0.0) for k, v in cpu_seconds().items()}
            row["life"] = lives(r, marks, driver_calls, os.path.join(folder, "gateway.jsonl"))
            rounds.append(row)
            print(f"round {r}: " + ", ".join(f"{p} {row[p]:.2f} s" for p in PATHS), flush=True)
    finally:
        client.shutdown()
    result = {"config": args.config, "prompts": args.prompts, "samples": args.samples, "max_tokens": args.max_tokens,
              "rounds": rounds, "median_s": {p: median([row[p] for row in rounds]) for p in PATHS}}
    result["overhead_pct"] = {p: round(100 * median([row[p] / row["driver"] - 1 for row in rounds]), 2)
                              for p in PATHS[1:]}
    # The same pairs with the engines' span (the router's submission to its batch's last sequence)
    # taken out of both sides: what the path itself adds, without the engines' round-to-round noise.
    result["own_overhead_pct"] = {p: round(100 * median([(own_s(row["life"][p]) - own_s(row["life"]["driver"]))
                                                         / row["driver"] for row in rounds]), 2) for p in PATHS[1:]}
    result["life_median_ms"] = life_medians(rounds)
    lines = [f"# Protocol overhead: {args.prompts} prompts x {args.samples} samples x {args.max_tokens} tokens, "
             f"{args.rounds} rounds", "", "| path | median makespan (s) | median paired overhead vs driver "
             "| same, outside the engines' span |", "|---|---|---|---|"]
    for p in PATHS:
        over = "- | -" if p == "driver" else f"{result['overhead_pct'][p]:+.2f} % | {result['own_overhead_pct'][p]:+.2f} %"
        lines.append(f"| {p} | {result['median_s'][p]:.2f} | {over} |")
    lines += ["", "Median ms per phase of a batch's life (bench/protocols.py MARKS; cpu_*: CPU ms of each process "
              "during the batch):", "", "| path | " + " | ".join(PHASE_NAMES) + " |", "|---|" + "---|" * len(PHASE_NAMES)]
    for p in PATHS:
        med = result["life_median_ms"][p]
        lines.append(f"| {p} | " + " | ".join("" if med.get(k) is None else f"{med[k]:.0f}" for k in PHASE_NAMES) + " |")
    save_result(args.out, "protocols", result, lines)
    return result


PHASE_NAMES = tuple(phase for _, phase in MARKS[1:]) + ("total", "fetches") + tuple(
    f"cpu_{k}" for k in ("bench", *CPU_OF))


def lives(r: int, marks: dict, driver_calls: list, gateway_file: str) -> dict:
    """Each path's life(...) in round `r`."""
    lines = []
    if os.path.exists(gateway_file):
        with open(gateway_file) as f:
            lines = [json.loads(x) for x in f if x.strip()]
    return {p: life(marks[p], [c for c in (driver_calls if p == "driver" else lines) if c["label"] == f"r{r}-{p}"])
            for p in marks}


def own_s(life_row: dict) -> float:
    """A batch's seconds outside the engines' span (its "generate" phase)."""
    return life_row["total"] - life_row.get("generate", 0.0)


def life_medians(rounds: list) -> dict:
    out = {}
    for p in PATHS:
        lifes = [row["life"][p] for row in rounds]
        out[p] = {k: round((1e3 if k != "fetches" else 1) * median([x[k] for x in lifes]), 1)
                  for k in PHASE_NAMES if all(k in x for x in lifes)}
    return out
