"""grpo.png: mean reward per step, and each step's time split into rollout, reward, train and sync."""
from __future__ import annotations

from pathlib import Path

PARTS = ("rollout", "reward", "train", "sync")
SMOOTH = 20  # steps in the reward curves' running mean


def smooth(values: list, weights: list) -> list:
    """Running mean of the last SMOOTH steps, each weighted by the samples it trained (a step that
    trained one group says less than one that trained 32; one that trained none, nothing)."""
    out = []
    for i in range(len(values)):
        pairs = [(v, w) for v, w in zip(values[max(0, i - SMOOTH + 1):i + 1], weights[max(0, i - SMOOTH + 1):i + 1])
                 if v is not None and w]
        total = sum(w for _, w in pairs)
        out.append(sum(v * w for v, w in pairs) / total if total else None)
    return out


def plot_run(metrics: list, path: Path, title: str) -> str:
    """Writes the PNG; returns a line saying where, or why not (no matplotlib, no steps)."""
    if not metrics:
        return "no steps ran: no plot"
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed: no plot (metrics.jsonl holds the numbers)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in metrics]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for key, label, color in (("reward", "mean reward (per-digit credit)", "C0"), ("exact", "exact reversals", "C1")):
        values = [m[key] for m in metrics]
        top.plot(steps, values, color=color, alpha=0.35, linewidth=0.8)
        top.plot(steps, smooth(values, [m["samples"] for m in metrics]), color=color,
                 label=f"{label}, {SMOOTH}-step mean")
    top.set_ylabel("reward")
    top.set_ylim(0, 1)
    top.grid(alpha=0.3)
    top.legend(loc="upper left")
    base = [0.0] * len(metrics)
    for part in PARTS:
        values = [m["time_s"][part] for m in metrics]
        bottom.bar(steps, values, bottom=base, label=part, width=1.0)
        base = [b + v for b, v in zip(base, values)]
    bottom.set_ylabel("step time (s)")
    bottom.set_xlabel("GRPO step")
    bottom.legend(loc="upper right")
    top.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"
