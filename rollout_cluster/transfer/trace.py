"""Where a weights sync spends its time, across processes (off by default).

With ROLLOUT_PUSH_TRACE set to a folder (in the environment of the driver that starts Ray, so the
replicas and vLLM's workers inherit it), each process appends `<folder>/<pid>.jsonl`: one line per
mark, {"t": wall-clock seconds, "pid", "event", ...}. Every process on a node shares the clock, so
experiments/weights-sync/breakdown.py lines the marks of the trainer, the replicas and their
workers up into one table.
"""
from __future__ import annotations

import json
import os
import time

ENV = "ROLLOUT_PUSH_TRACE"


def mark(event: str, **fields) -> None:
    folder = os.environ.get(ENV)
    if not folder:
        return
    fields.update(t=time.time(), pid=os.getpid(), event=event)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{os.getpid()}.jsonl"), "a") as f:
        f.write(json.dumps(fields) + "\n")
