"""Scheduling priority of the processes we start inside Ray workers.

Ray runs its workers at nice 15 (RAY_worker_niceness) so that raylet and GCS stay responsive. An
engine left there yields its core to every nice-0 process (the driver, raylet, GCS, the
dashboard), and a router left there answers pulls late whenever the engines keep every core busy
(measured on the 2-core CPU cluster: steal decisions with a p99 of 43 ms of wall time, 2.2 ms at nice 0).
"""
from __future__ import annotations

import os


def _threads() -> list:
    """Thread ids of this process (Linux: niceness is per thread), else [0]: the caller."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [0]


def set_niceness(target, setting: str = "engine.niceness", all_threads: bool = False) -> str | None:
    """Give the calling thread (or, with `all_threads`, every thread of this process) niceness
    `target`; processes spawned afterwards inherit it. Raising priority needs CAP_SYS_NICE (root
    has it): without it, return a warning naming `setting` and the other way
    (RAY_worker_niceness=0 at `ray start`). None: nothing to do, or done."""
    if target is None or not hasattr(os, "getpriority"):
        return None
    for tid in _threads() if all_threads else [0]:
        current = None
        try:
            current = os.getpriority(os.PRIO_PROCESS, tid)
            if current != target:
                os.setpriority(os.PRIO_PROCESS, tid, target)
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except OSError as e:
            was = "its current value" if current is None else current
            return (f"could not change the niceness from {was} to {target} ({setting}): {e}; "
                    "start Ray with RAY_worker_niceness=0 in the environment of `ray start`, or give the pod CAP_SYS_NICE")
    return None
