"""Benchmark output: DIR/bench.json (every figure), DIR/bench.md (the same as tables) and
DIR/bench.png (active sequences per replica over time, one panel per policy: the long tail).

Traces come as {policy: {replica_id: [(t, active sequences), ...]}}; the vLLM path converts the
router's (t, replica, held) entries with `trace_by_replica`.
"""
from __future__ import annotations

import json
from pathlib import Path

COLUMNS = [("makespan_s", "makespan (s)", "{:.2f}"), ("ratio_to_lower_bound", "ratio to LB", "{:.3f}"),
           ("tokens_per_s", "tokens/s", "{:.0f}"), ("tail_s", "tail 90→100 % (s)", "{:.2f}"),
           ("utilization", "utilization", "{:.3f}"), ("migrations", "migrations", "{}"),
           ("reprefill_pct", "re-prefill %", "{:.2f}"), ("reprefill_prefilled_pct", "of it prefilled %", "{:.2f}"),
           ("decision_ms_mean", "decision ms (mean)", "{:.3f}"),
           ("decision_ms_p99", "decision ms (p99)", "{:.3f}")]


def trace_by_replica(entries) -> dict:
    """[(t, replica_id, held)] -> {replica_id: [(t, held)]}, each sorted by time."""
    out: dict = {}
    for t, rid, held in entries:
        out.setdefault(rid, []).append((float(t), int(held)))
    for points in out.values():
        points.sort()
    return out


def _fmt(fmt: str, value) -> str:
    if value is None:
        return "-"
    return fmt.format(value)


def results_table(results: dict) -> str:
    """A Markdown table: one row per policy, the BENCHMARK.md figures as columns."""
    lines = ["| policy | " + " | ".join(title for _, title, _ in COLUMNS) + " |",
             "|---|" + "---:|" * len(COLUMNS)]
    for name, row in results.items():
        cells = [_fmt(fmt, row.get(key)) for key, _, fmt in COLUMNS]
        if "ratio_to_lower_bound_range" in row:
            lo, hi = row["ratio_to_lower_bound_range"]
            cells[1] += f" ({lo:.3f}–{hi:.3f})"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_summary(run: dict) -> str:
    """The lines above a table: what ran, and the bounds it is measured against."""
    w = run.get("workload", {})
    engine = run["engine"] + (" (a live cluster whose replicas host simulated engines: engine.kind sim)"
                              if run.get("replica_engine") == "sim" else "")
    lines = [f"engine **{engine}**, {run['replicas']} replicas, {run['sequences']} sequences, "
             f"{run['generated_tokens']} generated tokens",
             f"lower bound {run['lower_bound_s']:.2f} s, balance bound {run['balance_bound_s']:.2f} s "
             f"(profile `{run.get('profile', '?')}`: {run.get('bound_note', '')})"]
    if w:
        shown = {k: v for k, v in w.items() if k not in ("sequences", "generated_tokens")}
        lines.append("workload: " + ", ".join(f"{k}={v}" for k, v in shown.items()))
    if run.get("repeats"):
        from .repeats import describe

        lines.extend(describe(run["repeats"], run["results"]))
    if run.get("bare_engine"):
        lines.append("bare engine: " + ", ".join(f"{k}={v}" for k, v in run["bare_engine"].items()))
    return "\n\n".join(lines)


def markdown(result: dict) -> str:
    """bench.md: the summary table, then one table per seed when there are several."""
    title = "# Benchmark: makespan of an RL rollout batch\n\n"
    if "per_seed" not in result:
        return title + run_summary(result) + f"\n\nseed {result.get('seed')}\n\n" + results_table(result["results"]) + "\n"
    parts = [title + f"Mean over seeds {result['seeds']} (ratio range in brackets).\n",
             f"mean lower bound {result['lower_bound_s']:.2f} s, mean balance bound {result['balance_bound_s']:.2f} s\n",
             results_table(result["results"]) + "\n"]
    if result.get("repeats"):
        worst = result["repeats"]["worst_seed_median_pct"]
        parts.append("Worst seed's median paired difference (first policy's makespan against the second's): "
                     + "; ".join(f"{a} vs {b} {v:+.2f} %" for a, row in worst.items() for b, v in row.items()) + "\n")
    for run in result["per_seed"]:
        parts.append(f"\n## seed {run['seed']}\n\n" + run_summary(run) + "\n\n" + results_table(run["results"]) + "\n")
    return "\n".join(parts)


def plot(traces: dict, result: dict, path: Path) -> None:
    """One panel per policy: active sequences of every replica over time (a step line each),
    with the lower and balance bounds as vertical lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(traces)
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 2.2 * max(1, len(names)) + 0.6), sharex=True, squeeze=False)
    run = result["per_seed"][0] if "per_seed" in result else result
    for ax, name in zip(axes[:, 0], names):
        for rid, points in sorted(traces[name].items()):
            if points:
                ts, ns = zip(*points)
                ax.step(ts, ns, where="post", linewidth=0.7, alpha=0.8)
        ax.axvline(run["lower_bound_s"], color="k", linestyle="--", linewidth=0.8)
        ax.axvline(run["balance_bound_s"], color="grey", linestyle=":", linewidth=0.8)
        span = run["results"].get(name, {}).get("makespan_s")
        ax.set_title(f"{name}: makespan {span:.1f} s" if span is not None else name, fontsize=9, loc="left")
        ax.set_ylabel("active seqs")
    axes[-1, 0].set_xlabel("time since submission (s); dashed: lower bound, dotted: balance bound")
    fig.suptitle(f"{run['engine']}, {run['replicas']} replicas, {run['sequences']} sequences"
                 + (f", seed {run['seed']}" if "seed" in run else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_reports(result: dict, traces: dict, out: Path) -> str:
    """Write the three files; return the table printed to the terminal."""
    (out / "bench.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "bench.md").write_text(markdown(result))
    plot(traces or {}, result, out / "bench.png")
    return results_table(result["results"])


def save_result(out, name: str, result: dict, lines: list) -> None:
    """`out`/`name`.json (the raw result) and `name`.md (its table, `lines`), and print the table."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1))
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
