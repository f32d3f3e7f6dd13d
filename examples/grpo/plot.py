"""grpo.png: mean reward per step, and each step's time split into rollout, reward, train and sync."""
from __future__ import annotations

from pathlib import Path

PARTS = ("rollout", "reward", "train", "sync")


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
    top.plot(steps, [m["reward"] for m in metrics], label="mean reward (per-digit credit)")
    top.plot(steps, [m["exact"] for m in metrics], label="exact reversals", alpha=0.7)
    top.set_ylabel("reward")
    top.set_ylim(0, 1)
    top.grid(alpha=0.3)
    top.legend(loc="lower right")
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
