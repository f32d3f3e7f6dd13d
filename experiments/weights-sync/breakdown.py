"""Lines the marks of a traced weights-sync run up into where each sync's time went.

    ROLLOUT_PUSH_TRACE=/tmp/trace rollout-cluster weights-sync ... ; python breakdown.py /tmp/trace

Each sync is the span between the bench's `<way>_start` and `<way>_end` marks (the trainer's
process). Inside it, every other process's marks are taken relative to its start. Prints, per way,
the median over the rounds of each step's time (for a replica's steps: the slower replica).
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def load(folder: str) -> list:
    rows = []
    for f in Path(folder).glob("*.jsonl"):
        rows += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: r["t"])


def syncs(rows: list) -> list:
    out, open_ = [], {}
    for r in rows:
        for way in ("checkpoint", "push"):
            if r["event"] == f"{way}_start":
                open_[way] = r
            elif r["event"] == f"{way}_end" and way in open_:
                s = open_.pop(way)
                out.append((way, s["round"], s["t"], r["t"], [x for x in rows if s["t"] <= x["t"] <= r["t"]]))
    return out


def first(marks, event, pid=None):
    for m in marks:
        if m["event"] == event and (pid is None or m["pid"] == pid):
            return m["t"]
    return None


def last(marks, event, pid=None):
    t = None
    for m in marks:
        if m["event"] == event and (pid is None or m["pid"] == pid):
            t = m["t"]
    return t


def steps(way: str, t0: float, t1: float, marks: list) -> dict:
    """{step: seconds} of one sync; replica steps take the slowest replica."""
    s = {"total": t1 - t0}
    if way == "checkpoint":
        saved = first(marks, "checkpoint_saved")
        s["trainer: save_pretrained + manifest"] = saved - t0
        per = defaultdict(dict)
        for pid in {m["pid"] for m in marks if m["event"] == "reload_start"}:
            a, b = first(marks, "reload_start", pid), first(marks, "reload_end", pid)
            per[pid] = {"order -> replica starts the reload": a - saved, "replica: vLLM reload_weights": b - a,
                        "replica done -> client sees it": t1 - b}
        for k in ("order -> replica starts the reload", "replica: vLLM reload_weights", "replica done -> client sees it"):
            vals = [p[k] for p in per.values() if k in p]
            if vals:
                s[k] = max(vals) if k != "replica done -> client sees it" else min(vals)
        return s
    put0, ack = first(marks, "put_start"), first(marks, "router_ack")
    s["trainer: before the puts (wait for idle fleet)"] = put0 - t0
    # a streamed push (transfer/push.py) sends its order after the manifest and the first bucket;
    # the later puts overlap the replicas' loads
    before = [m["t"] for m in marks if m["event"] == "put_bucket" and m["t"] <= ack]
    s["trainer: pack + ray.put before the order"] = before[-1] - put0
    s["trainer: sign + router call"] = ack - before[-1]
    s["trainer: pack + ray.put after the order (overlapped)"] = max(0.0, last(marks, "put_bucket") - ack)
    # the same puts split (marks since bucket_packed): copying each bucket to host memory, then
    # ray.put's copy of it into the object store, summed over the push's buckets
    packed = {m["i"]: m["t"] for m in marks if m["event"] == "bucket_packed"}
    put = {m["i"]: m["t"] for m in marks if m["event"] == "put_bucket"}
    if packed and set(packed) == set(put):
        ends = [put0] + [put[i] for i in sorted(put)]
        s["trainer: of the puts, pack (copy to host memory)"] = sum(packed[i] - ends[k] for k, i in enumerate(sorted(put)))
        s["trainer: of the puts, ray.put (copy into the store)"] = sum(put[i] - packed[i] for i in put)
    per = {}
    for pid in {m["pid"] for m in marks if m["event"] == "load_start"}:
        a, e = first(marks, "load_start", pid), first(marks, "load_end", pid)
        here = [m["t"] for m in marks if m["pid"] == pid and m["event"] == "bucket_here"]
        staged = [m["t"] for m in marks if m["pid"] == pid and m["event"] == "bucket_staged"]
        fetch = (here[0] - a) + sum(max(0.0, h - st) for h, st in zip(here[1:], staged))
        write = sum(st - h for h, st in zip(here, staged))
        per[pid] = {"router ack -> replica starts": a - ack, "replica: ray.get (waited)": fetch,
                    "replica: stage (slot copy; store views: lookup)": write, "replica: load start -> end": e - a,
                    "replica: end (finalize)": e - last(marks, "loads_sent", pid),
                    "replica done -> client sees it": t1 - e}
    wl, ws = defaultdict(float), defaultdict(float)
    for m in marks:
        if m["event"] == "worker_load_start":
            wl[m["pid"]] -= m["t"]
        elif m["event"] == "worker_load_end":
            wl[m["pid"]] += m["t"]
        elif m["event"] == "worker_stage_start":  # (engines/device_staging.py: the bucket to the GPU first)
            ws[m["pid"]] -= m["t"]
        elif m["event"] == "worker_stage_end":
            ws[m["pid"]] += m["t"]
    for k in ("router ack -> replica starts", "replica: ray.get (waited)", "replica: stage (slot copy; store views: lookup)",
              "replica: load start -> end", "replica: end (finalize)", "replica done -> client sees it"):
        vals = [p[k] for p in per.values()]
        if vals:
            s[k] = min(vals) if k == "replica done -> client sees it" else max(vals)
    if wl:
        s["worker: load_weights of the buckets"] = max(wl.values())
        s["worker: of it, the buckets to the GPU through the ring (0: not staged)"] = max(ws.values()) if ws else 0.0
    return s


def main() -> None:
    rows = load(sys.argv[1])
    table = defaultdict(lambda: defaultdict(list))
    for way, rnd, t0, t1, marks in syncs(rows):
        for k, v in steps(way, t0, t1, marks).items():
            table[way][k].append(v)
    for way, st in table.items():
        print(f"\n| {way}: step | median s | rounds |\n|---|---:|---|")
        for k, vals in st.items():
            print(f"| {k} | {statistics.median(vals):.3f} | {' '.join(f'{v:.2f}' for v in vals)} |")


if __name__ == "__main__":
    main()
