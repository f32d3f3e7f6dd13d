"""`rollout-cluster demo`: a local CPU cluster runs one mixed-length batch and prints a summary.

A person sees a progress bar and the summary. Everything else (Ray's and Serve's logs, the
engines' vLLM logs, whatever a library prints) goes to one log file, named at the start and the end.
"""
from __future__ import annotations

import contextlib
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

from .config import load_config
from .protocol import SamplingSpec, partials
from .security.local import ensure_local_secrets
from .security.secrets import read_token


def demo_batch(prompts: int = 16, samples: int = 4, seed: int = 0, max_len: int = 400):
    """Prompts of 8-48 tokens; per-prompt lengths drawn long-tailed, shared by the group's samples."""
    rng = random.Random(seed)
    ids, specs = [], []
    for _ in range(prompts):
        ids.append([rng.randrange(3, 2000) for _ in range(rng.randint(8, 48))])
        length = int(min(max_len, max(16, rng.lognormvariate(4.5, 0.8))))
        specs.append(SamplingSpec(n=samples, max_tokens=length, temperature=1.0, ignore_eos=True, logprobs=0, seed=None))
    return ids, specs


def partial_rollout_steps(client, ids: list, specs: list, fraction: float) -> dict:
    """Cut a batch at `fraction` (generate's finish_fraction), then finish its cut samples in a
    second batch, continued after their tokens: what an RL step with partial rollouts does."""
    t0 = time.monotonic()
    first = client.generate(ids, specs, finish_fraction=fraction)
    cut_s = time.monotonic() - t0
    cut = [c for c in first if c.finish_reason == "abort"]
    carry, cut_specs = partials(ids, first), [specs[c.prompt_index] for c in cut]
    t1 = time.monotonic()
    second = client.generate(carry, cut_specs) if carry else []
    return {"finish_fraction": fraction, "cut_step_s": round(cut_s, 2), "cut_off": len(cut),
            "resumed_step_s": round(time.monotonic() - t1, 2) if carry else 0.0,
            "resumed_tokens": sum(c.resumed_tokens for c in second),
            "resumed_to_full_length": sum(len(c.token_ids) == spec.max_tokens for c, spec in zip(second, cut_specs))}


@contextlib.contextmanager
def output_to(log_path: Path):
    """This process's stdout and stderr go to `log_path`: sys.stdout and sys.stderr, and file
    descriptors 1 and 2, so also what Ray's C++ core and the processes it spawns print. Yields a
    stream to the terminal (the original stderr)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved_fds = os.dup(2), os.dup(1)
    saved_streams = sys.stdout, sys.stderr
    console = os.fdopen(os.dup(saved_fds[0]), "w", buffering=1)
    with open(log_path, "a", buffering=1) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.stdout = sys.stderr = log
        try:
            yield console
        finally:
            sys.stdout, sys.stderr = saved_streams
            os.dup2(saved_fds[0], 2)
            os.dup2(saved_fds[1], 1)
            for fd in saved_fds:
                os.close(fd)
            console.close()


@contextlib.contextmanager
def stderr_to(stream):
    """sys.stderr is `stream` inside: the driver's progress bar (tqdm) draws where it points."""
    old, sys.stderr = sys.stderr, stream
    try:
        yield
    finally:
        sys.stderr = old


def http_check(cfg) -> dict:
    """GET /<app> (the status) over HTTP without the token and with it: {"without": 401, "with": 200}."""
    import urllib.error
    import urllib.request

    url = f"http://127.0.0.1:{int(os.environ.get('ROLLOUT_HTTP_PORT', 8000))}/{cfg.app_name}"
    token = read_token(cfg.security)
    out = {}
    for name, headers in (("without_token", {}), ("with_token", {"Authorization": f"Bearer {token}"})):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
                out[name] = r.status
        except urllib.error.HTTPError as e:
            out[name] = e.code
    return out


def start_ray_quietly() -> str:
    """A local Ray whose workers' output stays in their log files (not streamed to this process),
    with the repository on the workers' PYTHONPATH as RolloutClient.start sets it. Returns Ray's
    session directory, whose logs/ hold the replicas' and engines' output."""
    import ray

    root = str(Path(__file__).resolve().parents[1])
    env = {"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}}
    ctx = ray.init(runtime_env=env, log_to_driver=False)
    return ctx.address_info["session_dir"]


def append_ray_logs(session_dir: str, log_path: Path) -> None:
    """Copy the workers' and Serve's logs of the Ray session into the demo's log file, one header each."""
    logs = Path(session_dir) / "logs"
    files = sorted(logs.glob("worker-*.out")) + sorted(logs.glob("worker-*.err")) + sorted(logs.glob("serve/*.log"))
    with open(log_path, "a") as out:
        out.write(f"\n===== Ray session logs ({logs}) =====\n")
        for f in files:
            text = f.read_text(errors="replace")
            if text.strip():
                out.write(f"\n===== {f.relative_to(logs)} =====\n{text}")


def run_demo(config_path: str, prompts: int = 16, samples: int = 4, log_dir: str = "logs") -> dict:
    from .client.client import RolloutClient
    from .model_maker import make_model

    cfg = load_config(config_path)
    log_path = Path(log_dir) / f"demo-{time.strftime('%Y%m%d-%H%M%S')}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"logs of Ray, Serve and the engines: {log_path}", flush=True)
    session_dir = None
    with output_to(log_path) as console:
        def say(msg: str) -> None:
            print(msg, file=console, flush=True)

        model_dir = Path(cfg.model_path())
        if cfg.engine.kind == "vllm" and not model_dir.exists() and not cfg.engine.load_format == "dummy":
            say(f"making the local model in {model_dir} ...")
            make_model(str(model_dir))
        say(f"starting a local Ray cluster with {cfg.replicas} {cfg.engine.kind} replicas (a minute or two) ...")
        for path in ensure_local_secrets(cfg):
            say(f"made {path} (mode 0600)")
        say(f"the HTTP token is in {cfg.security.token_file}: send it as `Authorization: Bearer <token>`")
        session_dir = start_ray_quietly()
        client = RolloutClient.start(cfg)  # joins the Ray started above, which ends below
        try:
            ids, specs = demo_batch(prompts, samples)
            say(f"one batch: {prompts} prompts x {samples} samples, policy {cfg.policy.name}")
            t0 = time.monotonic()
            with stderr_to(console):
                results = client.generate(ids, specs, progress=True)
            makespan = time.monotonic() - t0
            status = client.status()
            say("partial rollouts: the same batch cut at 90 %, then its cut samples resumed ...")
            partial = partial_rollout_steps(client, ids, specs, 0.9)
            http = http_check(cfg)
        finally:
            client.shutdown()
            import ray

            ray.shutdown()  # the demo's own Ray (start_ray_quietly): a client ends only a Ray it started
    if session_dir:
        append_ray_logs(session_dir, log_path)
    tokens = sum(len(r.token_ids) for r in results)
    per_replica = Counter(rep for r in results for rep in r.replicas[:1])
    summary = {
        "sequences": len(results), "tokens": tokens, "makespan_s": round(makespan, 2),
        "tokens_per_s": round(tokens / makespan, 1),
        "per_replica_sequences": dict(per_replica), "migrations": status["counters"]["migrations"],
        "finish_reasons": dict(Counter(r.finish_reason for r in results)),
        "policy": status["policy"],
        "partial_rollouts": partial,
        "http_status_answers": http,
    }
    print("\nrollout summary")
    for k, v in summary.items():
        print(f"  {k:22s} {v}")
    print(f"\nlogs of Ray, Serve and the engines: {log_path}")
    return summary
