"""Prometheus metrics of the router, served on `metrics.port` (0: off): the RouterMetrics hooks
(counters.py) exported, and gauges read from the core every second."""
from __future__ import annotations

import time
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ..router.core import RouterCore
from ..router.counters import RouterMetrics


# A replica that left keeps its counters' series this long, then they go: long enough for every
# scrape (and an alert's increase() window) to see their last counts, and the registry does not
# grow with every replica a fleet ever had (Serve names each replacement anew).
GONE_SERIES_KEEP_S = 900.0


class PrometheusRouterMetrics(RouterMetrics):
    def __init__(self, port: int = 0):
        self.registry = r = CollectorRegistry()
        self.queued = Gauge("rollout_sequences_queued", "Sequences waiting in the router's queue", registry=r)
        self.running = Gauge("rollout_sequences_running", "Sequences running, per replica", ["replica"], registry=r)
        self._running_labels: set = set()
        self.finished_total = Counter("rollout_sequences_finished_total", "Sequences finished, per replica and reason",
                                      ["replica", "reason"], registry=r)
        self.migrations = Counter("rollout_migrations_total", "Sequences moved between replicas", ["source"], registry=r)
        self.reprefill = Counter("rollout_reprefill_tokens_total", "Tokens prefilled again after a migration", registry=r)
        self.give_up_s = Histogram("rollout_give_up_latency_seconds", "Give-up ordered to partial received", registry=r,
                                   buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5))
        self.decision_s = Histogram("rollout_router_decision_seconds", "Policy decision time per pull", registry=r,
                                    buckets=(1e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1))
        self.replicas = Gauge("rollout_replicas_alive", "Engine replicas pulling", registry=r)
        self.expected = Gauge("rollout_replicas_expected", "Engine replicas the router expects (static's shares, "
                              "chunked's first round)", registry=r)
        self.resumed_total = Counter("rollout_sequences_resumed_total", "Sequences continued elsewhere because their "
                                     "replica left (replica_left) or was lost (replica_lost), or from what a "
                                     "restarted router's predecessor made (router_restart), or from a partial rollout an earlier "
                                     "batch cut off (partial; source -)", ["source", "reason"],
                                     registry=r)
        self.abandoned_total = Counter("rollout_batches_abandoned_total", "Batches cancelled and dropped because no "
                                       "driver fetched from them for router.abandoned_batch_s", registry=r)
        self.weights_version = Gauge("rollout_weights_version", "The weights version batches run on", registry=r)
        self.weights_failed = Gauge("rollout_replicas_weights_failed", "Replicas whose load of the current "
                                    "weights failed (they get no work)", registry=r)
        self.sleep_level = Gauge("rollout_sleep_level", "The fleet's vLLM sleep level (0: awake; batches are "
                                 "refused otherwise)", registry=r)
        self.refusals = Counter("rollout_control_refusals_total", "Control orders (and replica reports) the router "
                                "refused, by reason: unsigned, malformed, wrong_op, unknown_key, bad_signature, skew, "
                                "replay, path (outside security.checkpoint_roots), report_credential", ["reason"],
                                registry=r)
        self.busy_total = Counter("rollout_batches_refused_total", "Batches refused by a limit (limits.*)", ["limit"],
                                  registry=r)
        self.stalls_total = Counter("rollout_replica_stalls_total", "Replicas declared stalled: they held running "
                                    "sequences and reported no new token for router.stall_timeout_s (their sequences "
                                    "continued elsewhere; Serve replaces them)", registry=r)
        self._series: dict[str, set] = {}  # replica id -> (counter, label values) of its counters' series
        self._gone_since: dict[str, float] = {}  # replica id -> when gauges() first found it gone
        self.port = port
        if port:
            start_http_server(port, registry=r)

    def decision(self, seconds: float) -> None:
        self.decision_s.observe(seconds)

    def _count(self, counter: Counter, replica_id: str, *labels: str) -> None:
        """Count once in `counter`'s series of (replica_id, *labels), remembered for pruning."""
        counter.labels(replica_id, *labels).inc()
        self._series.setdefault(replica_id, set()).add((counter, (replica_id, *labels)))

    def migration(self, source: str, reprefill_tokens: int) -> None:
        self._count(self.migrations, source)
        self.reprefill.inc(reprefill_tokens)

    def give_up_latency(self, seconds: float) -> None:
        self.give_up_s.observe(seconds)

    def finished(self, replica_id: str, reason: str) -> None:
        self._count(self.finished_total, replica_id, reason)

    def resumed(self, source: str, reason: str) -> None:
        self._count(self.resumed_total, source, reason)

    def replica_stalled(self, replica_id: str) -> None:
        self.stalls_total.inc()

    def batches_abandoned(self, n: int) -> None:
        self.abandoned_total.inc(n)

    def refused(self, reason: str) -> None:
        self.refusals.labels(reason).inc()

    def batch_refused(self, limit: str) -> None:
        self.busy_total.labels(limit).inc()

    def gauges(self, core: RouterCore, now: Optional[float] = None) -> None:
        self.queued.set(len(core.queue))
        self.weights_version.set(core.weights.version)
        self.weights_failed.set(len(core.weights.errors))
        self.sleep_level.set(core.sleep.level)
        self.replicas.set(len(core.fleet.replicas))
        self.expected.set(core.fleet.expected)
        for rid, rep in core.fleet.replicas.items():
            self.running.labels(rid).set(len(rep.seqs))
        for rid in self._running_labels - set(core.fleet.replicas):  # gone: sum() must not count it
            self.running.remove(rid)
        self._running_labels = set(core.fleet.replicas)
        self._prune_gone(set(core.fleet.replicas), time.monotonic() if now is None else now)

    def _prune_gone(self, live: set, now: float) -> None:
        """Drop the counters' series of replicas gone for GONE_SERIES_KEEP_S ("-": none, kept)."""
        for rid in list(self._series):
            if rid in live or rid == "-":
                self._gone_since.pop(rid, None)
                continue
            since = self._gone_since.setdefault(rid, now)
            if now - since >= GONE_SERIES_KEEP_S:
                for counter, labels in self._series.pop(rid):
                    counter.remove(*labels)
                del self._gone_since[rid]
