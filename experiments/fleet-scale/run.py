"""Plot makespan over the balance bound against fleet size, from `rollout-cluster bench` outputs
(docs/benchmarks.md, section 1, "Fleets past 32 replicas").

    python experiments/fleet-scale/run.py experiments/seed-scale-simulator/results/sim-seed-a100-v2 experiments/fleet-scale/results/r*-p0.5 \
        --policies static,least-loaded,steal --out experiments/fleet-scale/results/ratio.png

Each directory holds one bench.json (one seed or several: the per-seed results are used).
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path


def points(dirs: list, policies: set) -> dict:
    """policy -> [(replicas, makespan / balance bound)], one point per seed."""
    out = defaultdict(list)
    for d in dirs:
        data = json.loads((Path(d) / "bench.json").read_text())
        runs = data.get("per_seed") or [data]
        for run in runs:
            for policy, r in run["results"].items():
                if policy in policies:
                    out[policy].append((run["replicas"], r["makespan_s"] / run["balance_bound_s"]))
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--policies", default="static,least-loaded,steal")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profile = json.loads((Path(a.dirs[0]) / "bench.json").read_text())["profile"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, pts in sorted(points(a.dirs, set(a.policies.split(","))).items()):
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=policy)
    ax.axhline(1.0, color="grey", lw=0.8, ls="--", label="balance bound")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("replicas (16 prompts per replica, 16 samples each)")
    ax.set_ylabel("makespan / balance bound")
    ax.set_title(f"rl-longtail, {profile}, seed 0")
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
