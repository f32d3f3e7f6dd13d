"""Repeated rounds of the same batch on a live cluster (`bench --engine vllm --repeats N`).

A real 2-replica run varies by several percent from one run to the next (shared cores, Ray's own
processes), so one run per seed cannot tell a 3 % difference. With N rounds, each policy runs the
seed's batch N times; round r starts the policy list at position r, so no policy always follows
the same one. A seed's row for a policy is the run with the median makespan, and `paired_pct`
compares policies round by round (runs of one round are minutes apart, not a whole seed).
"""
from __future__ import annotations

from typing import Sequence

from .flags import FlagError


def round_order(policies: Sequence[str], r: int) -> list:
    """Round r's order: the policy list rotated by r."""
    k = r % len(policies)
    return list(policies[k:]) + list(policies[:k])


def only_pairs(spec: str | None, seeds: list, rounds: int) -> set | None:
    """`--only SEED:ROUND,...` as a set of (seed, round), each checked against --seeds and --rounds;
    None when every pair runs."""
    if not spec:
        return None
    chosen = set()
    for item in str(spec).split(","):
        seed, sep, rnd = item.strip().partition(":")
        try:
            pair = (int(seed), int(rnd))
        except ValueError:
            pair = None
        if not sep or pair is None:
            raise FlagError(f"--only {item!r}: each pair is SEED:ROUND, e.g. 0:1")
        if pair[0] not in seeds or not 0 <= pair[1] < rounds:
            raise FlagError(f"--only {item!r}: not a pair of --seeds {','.join(map(str, seeds))} "
                            f"x --rounds {rounds}")
        chosen.add(pair)
    return chosen


def median_row(rows: Sequence[dict]) -> int:
    """Index of the run with the median makespan (the lower median for an even count)."""
    if not rows:
        raise ValueError("median_row: no runs")
    order = sorted(range(len(rows)), key=lambda i: rows[i]["makespan_s"])
    return order[(len(rows) - 1) // 2]


def median(values: Sequence[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2])


def paired_pct(makespans: dict) -> dict:
    """{a: {b: {"per_round": [100 (a_r / b_r - 1)], "median": ...}}} for every ordered pair of
    policies, from {policy: [makespan of round 0, 1, ...]}."""
    out: dict = {}
    for a, xs in makespans.items():
        for b, ys in makespans.items():
            if a == b:
                continue
            if len(xs) != len(ys):
                raise ValueError(f"paired_pct: {a} has {len(xs)} rounds, {b} has {len(ys)}")
            per = [round(100.0 * (x / y - 1.0), 2) for x, y in zip(xs, ys)]
            out.setdefault(a, {})[b] = {"per_round": per, "median": round(median(per), 2)}
    return out


def summarize_seed(rows_by_policy: dict) -> tuple:
    """(results {policy: median run's row + every round's makespan and migrations}, index of each
    median run, repeats dict) from {policy: [row of round 0, 1, ...]}."""
    spans = {name: [r["makespan_s"] for r in rows] for name, rows in rows_by_policy.items()}
    picked = {name: median_row(rows) for name, rows in rows_by_policy.items()}
    results = {name: {**rows[picked[name]], "makespans_s": spans[name],
                      "migrations_by_round": [r["migrations"] for r in rows],
                      "makespan_spread_pct": round(100.0 * (max(spans[name]) - min(spans[name])) / median(spans[name]), 2)}
               for name, rows in rows_by_policy.items()}
    rounds = len(next(iter(spans.values())))
    return results, picked, {"rounds": rounds, "paired_pct": paired_pct(spans)}


def across_seeds(repeat_summaries: Sequence[dict]) -> dict:
    """Over seeds: for every ordered pair, the worst (largest) per-seed median of a's makespan
    against b's, in %: "a is never slower than b on any seed by more than X %"."""
    worst: dict = {}
    for rep in repeat_summaries:
        for a, row in rep["paired_pct"].items():
            for b, cell in row.items():
                cur = worst.setdefault(a, {}).get(b)
                worst[a][b] = cell["median"] if cur is None else max(cur, cell["median"])
    return {"rounds": repeat_summaries[0]["rounds"] if repeat_summaries else 0, "worst_seed_median_pct": worst}


def describe(repeats: dict, results: dict) -> list:
    """Lines for bench.md: every round's makespans, and the paired medians."""
    lines = [f"{repeats['rounds']} rounds per policy, rotated order; each row is the median run. Makespans by round: "
             + "; ".join(f"{name} " + ", ".join(f"{s:.2f}" for s in row["makespans_s"])
                         for name, row in results.items() if "makespans_s" in row)]
    moved = [f"{name} " + ", ".join(str(m) for m in row["migrations_by_round"])
             for name, row in results.items() if any(row.get("migrations_by_round", []))]
    if moved:
        lines.append("migrations by round: " + "; ".join(moved))
    pairs = [f"{a} vs {b}: median {cell['median']:+.2f} % (rounds " + ", ".join(f"{p:+.1f}" for p in cell["per_round"]) + ")"
             for a, row in repeats["paired_pct"].items() for b, cell in row.items()]
    if pairs:
        lines.append("paired by round (makespan of the first against the second): " + "; ".join(pairs))
    return lines
