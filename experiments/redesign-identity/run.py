"""Issue 23's proof that nothing changed: the same simulator runs on two source trees, and the
trees' shape and import circles side by side.

    python experiments/redesign-identity/run.py --tree before=/path/to/old [--tree LABEL=/path ...] \
        --tree after=. --seeds 0,1,2 --out experiments/redesign-identity/results

The first and the last tree each run their own `rollout-cluster simulate` (python -m
rollout_cluster.cli) in a subprocess with PYTHONPATH set to that tree, one policy and seed at a
time, niced. Raw JSON per run goes to OUT/<label>/<policy>-seed<S>.json; the tables go to
OUT/tables.md and OUT/summary.json. The import circles reuse tests/test_import_circles.py of
this repository, pointed at each tree.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
POLICIES = "static,chunked,least-loaded,pull,steal"


def simulate(tree: Path, policy: str, seed: int, profile: str, replicas: int) -> dict:
    """One `simulate` run of `tree`'s own code: (bench.json form, with wall seconds added)."""
    cmd = ["nice", "-n", "10", sys.executable, "-m", "rollout_cluster.cli", "simulate", "--policy", policy,
           "--seed", str(seed), "--replicas", str(replicas), "--profile", profile]
    env = dict(os.environ, PYTHONPATH=str(tree))
    start = time.monotonic()
    done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True, check=True)
    run = json.loads(done.stdout)
    run["wall_s"] = round(time.monotonic() - start, 1)
    return run


def outcome(run: dict) -> dict:
    """What a run computed: every field but the measured times (decision ms, wall seconds)."""
    (policy, res), = run["results"].items()
    top = {k: v for k, v in run.items() if k not in ("results", "wall_s")}
    return {**top, policy: {k: v for k, v in res.items() if not k.startswith("decision_ms")}}


def tree_shape(tree: Path) -> dict:
    """{folder under rollout_cluster: (python files, lines)} of a tree on disk."""
    shape = {}
    for path in sorted((tree / "rollout_cluster").rglob("*.py")):
        folder = str(path.parent.relative_to(tree))
        files, lines = shape.get(folder, (0, 0))
        shape[folder] = (files + 1, lines + len(path.read_text().splitlines()))
    return shape


def import_circles(tree: Path) -> list:
    """The import circles among `tree`'s rollout_cluster modules, by tests/test_import_circles.py."""
    spec = importlib.util.spec_from_file_location("import_circles", REPO / "tests" / "test_import_circles.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.ROOT = tree  # modules() reads the tree from ROOT
    known = mod.modules()
    return mod.circles({name: mod.imported(name, path, known) for name, path in known.items()})


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", required=True,
                   help="LABEL=PATH, repeated; the simulator compares the first and the last")
    p.add_argument("--policies", default=POLICIES)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--profile", default="a100-80g-7b")
    p.add_argument("--replicas", type=int, default=32)
    p.add_argument("--no-sim", action="store_true", help="only the tree shape and the circles")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    trees = dict(t.split("=", 1) for t in a.tree)
    trees = {label: Path(path).resolve() for label, path in trees.items()}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"trees": {k: str(v) for k, v in trees.items()}, "runs": [], "shape": {}, "circles": {}}
    md = []

    if not a.no_sim:
        before, after = list(trees)[0], list(trees)[-1]
        md += [f"| seed | policy | makespan {before} (s) | makespan {after} (s) | migrations {before} | "
               f"migrations {after} | identical | every other field |", "|---:|---|---:|---:|---:|---:|---|---|"]
        for seed in [int(s) for s in a.seeds.split(",")]:
            for policy in a.policies.split(","):
                row, outcomes = {"seed": seed, "policy": policy}, []
                for label in (before, after):
                    run = simulate(trees[label], policy, seed, a.profile, a.replicas)
                    (out / label).mkdir(exist_ok=True)
                    (out / label / f"{policy}-seed{seed}.json").write_text(json.dumps(run, indent=1) + "\n")
                    res = run["results"][policy]
                    outcomes.append(outcome(run))
                    row[label] = {"makespan_s": res["makespan_s"], "migrations": res["migrations"],
                                  "wall_s": run["wall_s"]}
                same = (f"{row[before]['makespan_s']:.2f}" == f"{row[after]['makespan_s']:.2f}"
                        and row[before]["migrations"] == row[after]["migrations"])
                row["identical"] = same
                row["all_fields_equal"] = outcomes[0] == outcomes[1]
                summary["runs"].append(row)
                md.append(f"| {seed} | {policy} | {row[before]['makespan_s']:.2f} | {row[after]['makespan_s']:.2f} | "
                          f"{row[before]['migrations']} | {row[after]['migrations']} | {'yes' if same else '**no**'} | "
                          f"{'equal' if row['all_fields_equal'] else '**differ**'} |")
                print(md[-1], flush=True)
        md.append("")

    for label, tree in trees.items():
        shape = tree_shape(tree)
        summary["shape"][label] = {k: {"files": f, "lines": n} for k, (f, n) in shape.items()}
        summary["circles"][label] = import_circles(tree)
    folders = sorted({f for s in summary["shape"].values() for f in s})
    md += ["| folder | " + " | ".join(f"{label} files / lines" for label in trees) + " |",
           "|---|" + "---:|" * len(trees)]
    for folder in folders + ["total"]:
        cells = []
        for label in trees:
            s = summary["shape"][label]
            f, n = ((sum(v["files"] for v in s.values()), sum(v["lines"] for v in s.values()))
                    if folder == "total" else (s.get(folder, {}).get("files", 0), s.get(folder, {}).get("lines", 0)))
            cells.append(f"{f} / {n:,}" if f else "-")
        md.append(f"| {folder} | " + " | ".join(cells) + " |")
    md.append("")
    for label in trees:
        found = summary["circles"][label]
        md.append(f"Import circles, {label}: {len(found)}" + "".join(f"\n- {' <-> '.join(c)}" for c in found))
    (out / "tables.md").write_text("\n".join(md) + "\n")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("\n".join(md))
    return 0 if all(r["identical"] for r in summary["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
