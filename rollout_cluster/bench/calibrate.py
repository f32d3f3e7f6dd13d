"""`rollout-cluster calibrate`: measure one live vLLM engine and write a cost-model profile.

For each (batch B, prompt context C), with fresh random prompts each time (no prefix-cache hits):
- prefill_s: time to generate 1 token for B prompts of C tokens;
- step_s: (time for T+1 tokens - time for 1 token) / T, with ignore_eos.
Then a least-squares fit of step = a + c*(context tokens in the batch) + e*B, where the context is
the batch's mean during the measured steps, B*(C + (T+1)/2), as the cost model counts it; and
prefill_tokens_per_s from the prefill times less one fitted step (through the origin).
The profile YAML holds CostModel's fields only (load_profile reads it); the raw points and the
fit's errors go in comments and in a sidecar FILE.points.json.

The engines are VllmEngines driven directly with asyncio: no Ray. With `--engines N`, N engines
(ranks 0..N-1, placed as the cluster's replicas are) run every measurement at the same time and
each point is their mean: the step curve under the load of a full node, where engines share the
host's cores (on a small CPU host their EngineCore processes compete for the same cores).
"""
from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import replace
from pathlib import Path

from ..engines.cost_model import CostModel
from ..protocol import SamplingSpec, Work
from .flags import FlagError
from .repeats import median


def parse_ints(text: str, flag: str) -> list:
    try:
        values = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise FlagError(f"{flag}={text!r}: must be comma-separated integers") from None
    if not values or min(values) < 1:
        raise FlagError(f"{flag}={text!r}: must be integers >= 1")
    return values


async def timed_batch(engine, batch: int, context: int, tokens: int, rng: random.Random, vocab: int, tag: str) -> float:
    """Seconds for `batch` fresh prompts of `context` tokens to generate `tokens` tokens each."""
    spec = SamplingSpec(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    low = 3 if vocab > 4 else 0
    works = [Work(f"{tag}-{i}", 1, [rng.randrange(low, vocab) for _ in range(context)], spec)
             for i in range(batch)]
    t0 = time.monotonic()
    for w in works:
        engine.submit(w)
    await asyncio.gather(*[engine.tasks[(w.seq_id, 1)] for w in works if (w.seq_id, 1) in engine.tasks])
    elapsed = time.monotonic() - t0
    engine.drain()
    return elapsed


async def timed_together(engines: list, batch: int, context: int, tokens: int, rng: random.Random, vocab: int,
                         tag: str) -> float:
    """`timed_batch` on every engine at once; their mean."""
    times = await asyncio.gather(*[timed_batch(e, batch, context, tokens, rng, vocab, f"{tag}e{i}")
                                   for i, e in enumerate(engines)])
    return sum(times) / len(times)


async def measure(engines, batches: list, contexts: list, decode_tokens: int, vocab: int, repeats: int = 3) -> list:
    """One point per (B, C): prefill_s, step_s, the batch's mean context during the steps.
    Every batch size runs once first (first shapes are slow), and each timing is the minimum
    of `repeats` runs: interference from other work on the machine only ever adds time.
    `engines`: one engine, or a list measured together (their mean)."""
    engines = engines if isinstance(engines, list) else [engines]
    rng = random.Random(0)
    for b in batches:
        await timed_together(engines, b, min(contexts), 2, rng, vocab, f"warmup{b}")
    points = []
    for c in contexts:
        for b in batches:
            one = min([await timed_together(engines, b, c, 1, rng, vocab, f"p{b}x{c}r{r}") for r in range(repeats)])
            full = min([await timed_together(engines, b, c, decode_tokens + 1, rng, vocab, f"d{b}x{c}r{r}")
                        for r in range(repeats)])
            step = max(1e-9, (full - one) / decode_tokens)
            points.append({"batch": b, "context": c, "prefill_s": one, "step_s": step,
                           "batch_context_tokens": b * (c + (decode_tokens + 1) / 2),
                           "prefill_tok_s": b * c / one})
            print(f"B={b:4d} C={c:6d}  prefill {one * 1e3:9.2f} ms  step {step * 1e3:8.3f} ms", flush=True)
    return points


def fit_step(batch_and_context: list, steps: list) -> tuple:
    """((a, c, e), relative errors): least squares of step = a + c*context + e*B over the
    (B, context tokens) rows. A negative c or e is dropped and the rest refitted: noise must not
    make a cost negative."""
    import numpy as np

    X = np.array([[1.0, ctx, b] for b, ctx in batch_and_context], dtype=float)
    y = np.array(steps, dtype=float)
    keep = [0, 1, 2]
    while True:
        sol, *_ = np.linalg.lstsq(X[:, keep], y, rcond=None)
        coef = np.zeros(3)
        coef[keep] = sol
        negative = [k for k in keep if k > 0 and coef[k] < 0]
        if not negative:
            break
        keep.remove(negative[0])
    return tuple(float(v) for v in coef), np.abs(X @ coef - y) / y


def profile_from_samples(samples: list, base: CostModel, name: str) -> tuple:
    """(CostModel, fit info) with a, c, e fitted to step-time samples that replicas reported
    while serving a batch, [(running, context tokens, seconds per token per sequence)] (`bench --engine vllm` writes
    them to DIR/step_samples.json): the engine as it runs in the cluster, beside the router and
    the other engines. Prefill rate, KV and max_num_seqs come from `base` (a replica's reports
    carry no prefill timing)."""
    rows = [(b, ctx) for b, ctx, st in samples if b > 0 and st > 0]
    steps = [st for b, ctx, st in samples if b > 0 and st > 0]
    if len(rows) < 10:
        raise ValueError(f"only {len(rows)} usable step samples: run a longer batch")
    (a, c, e), rel = fit_step(rows, steps)
    model = replace(base, name=name, a=max(a, 1e-6), c=c, e=e,
                    source=f"fit of {len(rows)} step-time reports of a live cluster; prefill and KV from {base.name}")
    return model, {"samples": len(rows), "median_rel_error": float(median(list(rel))),
                   "mean_rel_error": float(rel.mean())}


def fit(points: list) -> dict:
    """Least squares: step = a + c*context + e*B, over the points whose step time is positive (a
    decode run no slower than its 1-token run means interference, not a measurement: the point
    is dropped and listed). A term whose coefficient comes out negative is dropped and the rest
    refitted: noise must not make a cost negative. The prefill rate is fitted through the origin
    on the prefill time less one fitted step. Returns a, c, e, prefill_tokens_per_s and the
    fit's relative errors over the points kept."""
    import numpy as np

    good = [p for p in points if p["step_s"] > 1e-6]
    dropped = [(p["batch"], p["context"]) for p in points if p["step_s"] <= 1e-6]
    if len(good) < 3:
        raise ValueError(f"only {len(good)} usable points (dropped {dropped}): measure more batches or contexts")
    (a, c, e), rel = fit_step([(p["batch"], p["batch_context_tokens"]) for p in good], [p["step_s"] for p in good])
    tokens = np.array([p["batch"] * p["context"] for p in good], dtype=float)
    step1 = np.array([a + c * p["batch"] * p["context"] + e * p["batch"] for p in good])
    net = np.maximum(np.array([p["prefill_s"] for p in good]) - step1, 1e-9)
    rate = float((tokens * tokens).sum() / (tokens * net).sum())
    return {"a": a, "c": c, "e": e, "prefill_tokens_per_s": rate,
            "max_rel_error": float(rel.max()), "mean_rel_error": float(rel.mean()),
            "rel_errors": [round(float(r), 4) for r in rel], "dropped_points": dropped}


def kv_tokens_of(engine, cfg) -> tuple:
    """(KV capacity in tokens, where the number came from)."""
    vc = engine.engine.vllm_config
    blocks = getattr(vc.cache_config, "num_gpu_blocks", None)
    if blocks:
        return int(blocks) * int(vc.cache_config.block_size), "engine (num_gpu_blocks x block_size)"
    mc, pc = vc.model_config, vc.parallel_config
    per_token = 2 * mc.get_num_layers(pc) * mc.get_num_kv_heads(pc) * mc.get_head_size() * mc.dtype.itemsize
    space = cfg.engine.cpu_kv_cache_gib * (1 << 30)
    return int(space // per_token), f"VLLM_CPU_KVCACHE_SPACE {cfg.engine.cpu_kv_cache_gib} GiB / {per_token} B per token"


def step_curve(points: list) -> str:
    """Step time against batch at the smallest context, and the largest batch's slowdown."""
    c0 = min(p["context"] for p in points)
    row = sorted((p["batch"], p["step_s"]) for p in points if p["context"] == c0)
    lines = [f"step curve at context {c0}:"] + [f"  B={b:4d}  {s * 1e3:8.3f} ms" for b, s in row]
    if len(row) > 1:
        lines.append(f"  step(B={row[-1][0]}) / step(B={row[0][0]}) = {row[-1][1] / row[0][1]:.2f}")
    return "\n".join(lines)


def write_profile(path: Path, model: CostModel, points: list, result: dict, kv_source: str) -> None:
    comments = [f"# calibrated by `rollout-cluster calibrate`; kv_tokens from {kv_source}",
                f"# fit step = a + c*context + e*B: max rel error {result['max_rel_error']:.3f}, "
                f"mean {result['mean_rel_error']:.3f} over {len(points) - len(result['dropped_points'])} points"
                + (f", dropped {result['dropped_points']}" if result["dropped_points"] else ""),
                "# points (batch, context, prefill_s, step_s):"]
    comments += [f"#   {p['batch']}, {p['context']}, {p['prefill_s']:.6f}, {p['step_s']:.6f}" for p in points]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(comments) + "\n" + model.to_yaml())
    sidecar = path.with_name(path.name + ".points.json")
    sidecar.write_text(json.dumps({"profile": model.name, "fit": result, "points": points}, indent=1) + "\n")


def engine_config(path: str):
    """The cluster config, even when its engine.sim_profile is the very file being calibrated
    (load_config refuses a profile that does not exist yet; calibration does not use it)."""
    import yaml

    from ..config import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as e:
        if "engine.sim_profile" not in str(e):
            raise
    data = yaml.safe_load(Path(path).read_text()) or {}
    data.setdefault("engine", {})["sim_profile"] = "a100-80g-7b"
    cfg = load_config(data)
    here = Path(path).resolve().parent
    cfg.base_dir = str(here.parent if here.name == "configs" else here)  # as load_config resolves it
    return cfg


def whole_words_in(part: str, key: str) -> bool:
    """Whether `part`'s words are a run of whole words of `key` ('seed 1' is in 'seed 1 pull', not
    in 'seed 10 pull'; 'pull r1' is not in 'pull r10')."""
    want, words = part.split(), key.split()
    return bool(want) and any(words[i:i + len(want)] == want for i in range(len(words) - len(want) + 1))


def calibrate_from_samples(args) -> CostModel:
    """`calibrate --from-samples DIR/step_samples.json --base-profile P --out FILE`."""
    from ..engines.cost_model import load_profile

    if not args.base_profile:
        raise FlagError("--from-samples needs --base-profile (the prefill rate and KV capacity come from it)")
    data = json.loads(Path(args.from_samples).read_text())
    keys = [k for k in data if not args.samples_of or whole_words_in(args.samples_of, k)]
    if not keys:
        raise FlagError(f"--samples-of={args.samples_of!r}: no run in {args.from_samples} (runs: {', '.join(data)})")
    samples = [tuple(x) for k in keys for x in data[k]]
    try:
        base = load_profile(args.base_profile)
    except ValueError as e:
        raise FlagError(f"--base-profile: {e}") from None
    try:
        model, info = profile_from_samples(samples, base, args.name or f"{base.name}-cluster")
    except ValueError as e:
        raise FlagError(f"--from-samples={args.from_samples} (runs {', '.join(keys)}): {e}") from None
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        f"# fitted by `rollout-cluster calibrate --from-samples {args.from_samples}` over runs: {', '.join(keys)}\n"
        f"# {info['samples']} step-time reports; median rel. error {info['median_rel_error']:.3f}, "
        f"mean {info['mean_rel_error']:.3f}\n" + model.to_yaml())
    print(f"a={model.a:.3e} s  c={model.c:.3e} s/token  e={model.e:.3e} s/seq  from {info['samples']} reports "
          f"(median rel. error {info['median_rel_error']:.1%}); prefill and KV from {base.name}")
    print(f"wrote {args.out}")
    return model


def calibrate(args) -> CostModel:
    """Start one engine, measure, fit, write the profile; print the fit and the step curve."""
    from ..engines.vllm_engine import VllmEngine

    if getattr(args, "from_samples", None):
        return calibrate_from_samples(args)
    if not args.config:
        raise FlagError("calibrate needs --config (the engine to measure) or --from-samples")
    cfg = engine_config(args.config)
    batches = parse_ints(args.batches, "--batches")
    contexts = parse_ints(args.contexts, "--contexts")
    need = max(contexts) + args.decode_tokens + 2
    if need > cfg.engine.max_model_len:
        raise FlagError(f"--contexts up to {max(contexts)} + {args.decode_tokens} tokens exceed "
                        f"engine.max_model_len={cfg.engine.max_model_len}")
    for flag, value in (("--decode-tokens", args.decode_tokens), ("--repeats", getattr(args, "repeats", 1))):
        if value < 1:  # (else a division by zero or an empty min, after the engines started)
            raise FlagError(f"{flag}={value}: must be >= 1")
    if getattr(args, "engines", 1) < 1:
        raise FlagError(f"--engines={args.engines}: must be >= 1")
    if max(batches) > cfg.engine.max_num_seqs:
        raise FlagError(f"--batches up to {max(batches)} exceed engine.max_num_seqs={cfg.engine.max_num_seqs}")
    return asyncio.run(_calibrate(args, cfg, batches, contexts, VllmEngine))


async def _calibrate(args, cfg, batches: list, contexts: list, engine_cls) -> CostModel:
    n = getattr(args, "engines", 1) or 1
    engines = [engine_cls(cfg.engine, cfg.model_path(), rank=i) for i in range(n)]
    t0 = time.monotonic()
    try:
        infos = [await e.start() for e in engines]
        init_s = (time.monotonic() - t0) / n
        points = await measure(engines, batches, contexts, args.decode_tokens, infos[0].vocab_size,
                               getattr(args, "repeats", 3))
        kv, kv_source = kv_tokens_of(engines[0], cfg)
    finally:
        for e in engines:
            await e.shutdown()
    result = fit(points)
    name = args.name or f"calibrated-{Path(cfg.engine.model).name}"
    model = CostModel(name=name, a=result["a"], c=result["c"], e=result["e"],
                      prefill_tokens_per_s=result["prefill_tokens_per_s"], kv_tokens=kv,
                      max_num_seqs=cfg.engine.max_num_seqs,
                      source=f"rollout-cluster calibrate: {cfg.engine.model}, {n} engine(s) measured together, "
                             f"engine start {init_s:.0f} s, "
                             f"max rel error {result['max_rel_error']:.2f}")
    if model.a <= 0:
        print("warning: the fitted a is not positive; the step curve is too flat or too noisy to fit")
        model = replace(model, a=max(model.a, 1e-6))
    write_profile(Path(args.out), model, points, result, kv_source)
    print(f"a={model.a:.3e} s  c={model.c:.3e} s/token  e={model.e:.3e} s/seq  "
          f"prefill {model.prefill_tokens_per_s:.0f} tok/s  kv_tokens {kv} ({kv_source})")
    print(f"max relative error of the step fit: {result['max_rel_error']:.1%}")
    if result["dropped_points"]:
        print(f"dropped (B, C) points whose decode run was no slower than prefill: {result['dropped_points']}; "
              "was something else running? consider measuring again")
    print(step_curve(points))
    print(f"wrote {args.out} and {args.out}.points.json")
    return model
