"""The Router deployment's status(): what RolloutClient.status, the Gateway's `GET /<app>` and
the benchmarks read (the fleet, the batches, the weights and sleep state, counters, the router's
own cost)."""
from __future__ import annotations

import resource
import time
from dataclasses import asdict


def status_of(router) -> dict:
    c = router.core
    dt = c.decision_times[-10000:]
    return {
        "replicas": {rid: {"running": len(r.seqs), "capacity": r.capacity, "pulls": r.pulls,
                           "step_time_s": r.stats.step_time_s} for rid, r in c.fleet.replicas.items()},
        "queued": len(c.queue), "live_sequences": len(c.seqs), "batches": len(c.batches),
        "batch_ids": c.batches.status(time.monotonic()),  # cancel one: RolloutClient.cancel(batch_id)
        "policy": c.policy.name, "counters": asdict(c.counters),
        "model": None if c.model is None else c.model.__dict__,
        "decision_ms_mean": 1e3 * sum(dt) / len(dt) if dt else 0.0,
        "decision_ms_p99": 1e3 * sorted(dt)[int(0.99 * (len(dt) - 1))] if dt else 0.0,
        "weights": c.weights_status(),
        "sleep": c.sleep_status(),  # level 0: awake
        "expected_replicas": c.fleet.expected,
        "sampling_defaults": router.cfg.sampling.spec_fields(),  # what a request leaves out
        "router_id": router.router_id,
        "router_uptime_s": round(time.monotonic() - router.started_t, 1),
        # the router process's peak resident memory (it holds every token of its live batches)
        "router_rss_peak_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "router_cpu_s": time.process_time(),  # CPU seconds of the router's process so far
        # control orders whose signature held, and those refused (and reports without a credential) by reason
        "control": {"accepted": router.verifier.accepted, "refused": dict(router.verifier.refusals)},
        "sessions": c.sessions.status(),  # multi-turn session affinity (router/sessions.py)
    }
