"""Sum up a run's timelines (serve/timeline.py) and py-spy profiles (collapsed stacks).

    python experiments/router-overhead/timeline_summary.py DIR [PYSPY.txt ...]

DIR holds replica-*.jsonl and bare.jsonl. Prints each event loop's lag (how late a 5 ms timer
woke), the busy replica's pulls (what they carried, where their time went), the replica's decode
rate in 2 s windows of its first batch, and each profile's active samples by leaf frame.
"""
import json
import math
import sys
from collections import Counter
from pathlib import Path


def pct(values, q):
    """Nearest rank, as the benchmarks' percentile (bench/run.py): the ceil(q * n)-th smallest."""
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))] if v else float("nan")


def lag(lines, name):
    lags = [x["worst_ms"] for x in lines if x["kind"] == "lag"]
    print(f"{name}: event-loop lag over {len(lags)} samples: median {pct(lags, .5):.1f} ms, "
          f"p90 {pct(lags, .9):.1f}, p99 {pct(lags, .99):.1f}, max {max(lags, default=math.nan):.1f}")


def read_lines(path: Path) -> list:
    """A timeline's records; a line that does not parse (the last, torn, of a run cut short) is
    skipped and counted."""
    out, torn = [], 0
    for x in path.read_text().splitlines():
        try:
            out.append(json.loads(x))
        except json.JSONDecodeError:
            torn += 1
    if torn:
        print(f"{path.name}: {torn} line(s) that do not parse skipped")
    return out


def pulls(lines):
    ps = [x for x in lines if x["kind"] == "pull"]
    most = max((p["held"] for p in ps), default=0)
    busy = [p for p in ps if p["held"] >= 0.8 * most]  # the bulk phase: at least 80 % of the most it held
    print(f"replica: {len(ps)} pulls, {len(busy)} while holding {0.8 * most:.0f}+ sequences; of those (median, p90):")
    for k in ("progress", "tokens", "report_ms", "pull_ms", "apply_ms", "pace_ms"):
        print(f"  {k:10s} {pct([p[k] for p in busy], .5):9.2f} {pct([p[k] for p in busy], .9):9.2f}")
    starts = [i for i, p in enumerate(ps) if p["start"] >= 0.8 * most]
    if starts:
        i0, t0 = starts[0], ps[starts[0]]["t"]
        end = starts[1] if len(starts) > 1 else len(ps)
        windows, held = Counter(), {}
        for p in ps[i0:end]:
            k = int((p["t"] - t0) // 2)
            windows[k] += p["tokens"]
            held[k] = p["held"]
        print("first batch, 2 s windows: (start s, tokens/s, held, tokens/s per held)")
        print("  " + ", ".join(f"({2 * k}, {windows[k] / 2:.0f}, {held[k]}, {windows[k] / 2 / held[k]:.0f})"
                               for k in sorted(windows) if held[k]))


def profile(path):
    if not Path(path).exists():  # (gpu.sh's py-spy found no process to sample)
        print(f"{path}: missing")
        return
    leaf, total = Counter(), 0
    for line in open(path):
        stack, _, n = line.rstrip().rpartition(" ")
        leaf[stack.split(";")[-1]] += int(n)
        total += int(n)
    print(f"{path}: {total} active samples; top leaves:")
    for f, c in leaf.most_common(12):
        print(f"  {c:6d} {f[:140]}")


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    for f in sorted([*folder.glob("replica-*.jsonl"), *folder.glob("bare.jsonl")]):
        lines = read_lines(f)
        lag(lines, f.stem)
        if f.stem.startswith("replica"):
            pulls(lines)
    for p in sys.argv[2:]:
        profile(p)
