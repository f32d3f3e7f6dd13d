"""A replica's timeline, for finding where time goes beside the engine's steps (off by default).

With ROLLOUT_TIMELINE_DIR set in the replica's environment, each replica (and the bench's bare
engine) writes `<dir>/<name>.jsonl`: one line per pull of the loop (when it started, what it
carried, how long each part took) and, every PROBE_EVERY_S, the event loop's lag: how late a
timer that asked for PROBE_S woke. The engine's output handling (vLLM's AsyncLLM) shares that
loop, so its lag is the delay every output of the engine waits before the replica sees it.
experiments/router-overhead/timeline_summary.py sums the files up.
"""
from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Optional

ENV = "ROLLOUT_TIMELINE_DIR"
PROBE_S = 0.005  # the lag probe's timer
PROBE_EVERY_S = 0.05  # how often a lag sample is written (the worst lag seen since the last one)


class Timeline:
    def __init__(self, path: str):
        self.path = path
        self.file = open(path, "w", buffering=1 << 16)
        self.t0 = time.monotonic()
        self._probe: Optional[asyncio.Task] = None

    @classmethod
    def from_env(cls, name: str) -> Optional["Timeline"]:
        """A timeline for `name` if ROLLOUT_TIMELINE_DIR is set, else None (recording is off)."""
        folder = os.environ.get(ENV)
        if not folder:
            return None
        os.makedirs(folder, exist_ok=True)
        return cls(os.path.join(folder, f"{name}.jsonl"))

    def record(self, kind: str, at: Optional[float] = None, **fields) -> None:
        """A line of `kind`; its `t` is `at` (a time.monotonic() reading: when the thing began), else now."""
        fields["kind"], fields["t"] = kind, round((time.monotonic() if at is None else at) - self.t0, 5)
        self.file.write(json.dumps(fields) + "\n")

    def start_probe(self) -> None:
        """Sample the running event loop's lag until close()."""
        self._probe = asyncio.get_running_loop().create_task(self._lag_probe())

    async def _lag_probe(self) -> None:
        worst, since = 0.0, time.monotonic()
        while True:
            t = time.monotonic()
            await asyncio.sleep(PROBE_S)
            worst = max(worst, time.monotonic() - t - PROBE_S)
            if time.monotonic() - since >= PROBE_EVERY_S:
                self.record("lag", worst_ms=round(1e3 * worst, 3))
                worst, since = 0.0, time.monotonic()

    def close(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        self.file.close()
