"""What the router counts, and the hooks through which a metrics backend watches it.

`RouterCounters` is plain data: the router adds to it, `status()` reports it, benchmarks read it.
`RouterMetrics` is the interface a metrics backend implements (router/metrics.py: Prometheus);
its methods are no-ops here, so the simulator and the tests run without one.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RouterCounters:
    """Totals since the router started (or since set_policy reset them)."""

    migrations: int = 0  # segments a policy gave up at one replica to continue at another
    reprefill_tokens: int = 0  # context (prompt + partial) sent to migration destinations
    # What the engines reported actually prefilling for continuations (prefix-cache hits out), over
    # `reprefill_segments_measured` continuation segments that reported it (vLLM only).
    reprefilled_tokens: int = 0
    reprefill_segments_measured: int = 0
    # Fresh segments' prompts, as the engines reported their prefix-cache hits (vLLM only): the
    # prompt tokens measured and those found cached (hit rate = cached / measured).
    prompt_tokens_measured: int = 0
    prompt_cached_tokens: int = 0
    generated_tokens: int = 0  # tokens accepted from the replicas
    stale_reports: int = 0  # progress of an attempt the router no longer runs there (dropped)
    duplicate_reports: int = 0  # progress sent again after a lost reply (dropped)
    # reports that started past the tokens the router held (tokens between them lost): not applied,
    # the sequence continued from what the router held
    report_gaps: int = 0
    finals_whole_trimmed: int = 0  # whole finals of which only the tokens the router lacked were kept
    policy_errors: int = 0  # assignments or give-ups the policy made of sequences no longer eligible
    replica_deaths: int = 0  # replicas that stopped pulling, restarted, or whose engine died
    replica_leaves: int = 0  # replicas that Serve stopped on purpose (they handed their work back)
    # replicas that pulled on while their running sequences made no progress for router.stall_timeout_s:
    # their work continued elsewhere (counted in `recovered`), and they were told to stop
    replica_stalls: int = 0
    lost_orders: int = 0  # work or give-ups sent in a reply the replica never received (sent again)
    handed_back: int = 0  # sequences a leaving replica handed back with every token
    weights_recomputed: int = 0  # running sequences given up by an in-flight weights update, continued on the new weights
    weights_kept: int = 0  # running sequences whose weights were swapped under them (running="keep")
    recovered: int = 0  # sequences continued from their last reported tokens after their replica was lost
    # segments an engine ended with a retryable error (SeqProgress.retryable) that continued from their
    # tokens so far (router.engine_error_retries bounds them per sequence; also counted in `recovered`)
    engine_error_retries: int = 0
    orphans_given_up: int = 0  # attempts a replica ran that this router did not know (a predecessor's)
    orphan_outputs_kept: int = 0  # whole outputs of such attempts kept for their resubmission
    whole_finals_asked: int = 0  # such finals that came as deltas and were asked for again, whole
    adopted: int = 0  # resubmitted sequences that took a predecessor's output over
    adopted_tokens: int = 0  # and the tokens they took
    partials_resumed: int = 0  # partial rollouts resumed (SequenceRequest.output_token_ids)
    partial_tokens_resumed: int = 0  # and the tokens they came with


class RouterMetrics:
    """Hooks the router calls as things happen; a backend overrides what it exports."""

    def decision(self, seconds: float) -> None:
        """One policy decision took `seconds`."""

    def migration(self, source: str, reprefill_tokens: int) -> None:
        """A sequence left `source` by the policy's choice; its destination re-prefills this much."""

    def give_up_latency(self, seconds: float) -> None:
        """From a give-up order to the source's final report of it."""

    def finished(self, replica_id: str, reason: str) -> None:
        """A sequence ended (replica "-": it never ran, or ran nowhere at its end)."""

    def resumed(self, source: str, reason: str) -> None:
        """A sequence continues from output made elsewhere: replica_left, replica_lost, router_restart, partial."""

    def gauges(self, core) -> None:
        """A periodic look at the router's state (a RouterCore: queue, fleet, weights, sleep)."""

    def replica_stalled(self, replica_id: str) -> None:
        """The router declared `replica_id` stalled (RouterCore.check_stalls)."""

    def batches_abandoned(self, n: int) -> None:
        """`n` batches were dropped because no driver fetched from them."""
