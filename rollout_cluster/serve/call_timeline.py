"""Where an HTTP batch's time goes between the client and the router (off by default).

With ROLLOUT_GATEWAY_TIMELINE_DIR set in the Gateway's environment, the Gateway writes
`<dir>/gateway.jsonl`: for each request, when it came in and when its answer was ready, and for
each router call it made (submit_batch, fetch), when it was sent and answered, with what came
back. Times are time.monotonic(), one clock for every process of a node, so a client on the same
node lines its own times up with them (`rollout-cluster protocol-overhead --timeline`).
TimedRouter wraps any router handle; the bench wraps the driver's with it too.
"""
from __future__ import annotations

import contextvars
import json
import os
import time
from typing import Callable, Optional

ENV = "ROLLOUT_GATEWAY_TIMELINE_DIR"
TRACE_HEADER = "X-Rollout-Trace"  # a request's label in the timeline (the bench sends one)
TIMED = ("submit_batch", "fetch")  # the router calls a timeline follows

# the label of the request the current task serves (set by the Gateway's middleware)
current_label: contextvars.ContextVar = contextvars.ContextVar("rollout_trace_label", default="")


class CallTimeline:
    """Lines of {"label", "kind", "t", ...} appended to one file (or handed to `sink`)."""

    def __init__(self, path: Optional[str] = None, sink: Optional[Callable[[dict], None]] = None):
        self.file = open(path, "a", buffering=1) if path else None
        self.sink = sink

    @classmethod
    def from_env(cls, name: str = "gateway") -> Optional["CallTimeline"]:
        folder = os.environ.get(ENV)
        if not folder:
            return None
        os.makedirs(folder, exist_ok=True)
        return cls(os.path.join(folder, f"{name}.jsonl"))

    def record(self, kind: str, t: Optional[float] = None, **fields) -> None:
        line = {"label": current_label.get(), "kind": kind, "t": time.monotonic() if t is None else t, **fields}
        if self.sink is not None:
            self.sink(line)
        if self.file is not None:
            self.file.write(json.dumps(line) + "\n")


class TimedRouter:
    """`router` (a Serve handle, or a SignedRouter), its submit_batch and fetch calls timed."""

    def __init__(self, router, timeline: CallTimeline):
        self.router, self.timeline = router, timeline

    def __getattr__(self, name: str):
        method = getattr(self.router, name)
        return _TimedMethod(method, name, self.timeline) if name in TIMED else method


class _TimedMethod:
    def __init__(self, method, name: str, timeline: CallTimeline):
        self.method, self.name, self.timeline = method, name, timeline

    def remote(self, *args, **kwargs):
        return _TimedResponse(self.method.remote(*args, **kwargs), self.name, self.timeline)


class _TimedResponse:
    def __init__(self, response, name: str, timeline: CallTimeline):
        self.response, self.name, self.timeline = response, name, timeline
        self.sent = time.monotonic()

    def _answered(self, answer):
        fields = {}
        if self.name == "fetch":
            new, cursor, done = answer
            fields = {"new": len(new), "cursor": cursor, "done": bool(done),
                      "last_finish_s": max((c.finish_time_s for c in new), default=None)}
        self.timeline.record(self.name, sent=self.sent, **fields)
        return answer

    def __await__(self):
        answer = yield from self.response.__await__()
        return self._answered(answer)

    def result(self, *args, **kwargs):
        return self._answered(self.response.result(*args, **kwargs))
