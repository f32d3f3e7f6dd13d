"""RouterCore: the single owner of sequence state. No Ray, no asyncio, no clock.

The Ray Serve Router deployment wraps it in asyncio; the simulator drives it in virtual time; the
tests call it directly. A replica's pull is two calls, as vLLM v1's scheduler splits
`update_from_output` and `schedule`:
    applied = core.apply(report, now)       # register, take its state, its tokens, its listing
    orders = core.decide(replica_id, now)   # the policy's decision, and what waits for it
(`on_report` does both.) Drivers call `submit`, `fetch` and `cancel`; a periodic `expire` declares
silent replicas dead, a periodic `drop_abandoned` drops the batches nobody fetches (and
`drop_finished` those fetched whole whose driver never said it got the answer), and a periodic
`check_stalls` (also run at each report) declares stalled those that pull on while their sequences
make no progress: their work continues elsewhere as a dead replica's does, and their further
pulls are answered with an order to stop. Migration semantics: docs/semantics.md.

This class is a table of contents: each part is a component that owns its state, built here
with the objects it shares (the live sequences `seqs`, the `queue`, the `batches`, the `fleet`,
the `outbox`, the `counters`):
- intake.py: a driver's batches in (refused, checked, queued) and out (cancel, abandoned);
- reports.py: a replica's report taken in (engine state, progress, listing);
- dispatch.py: the policy and its decision at a pull, and the orders that leave with it;
- moves.py: a sequence's moves (dispatch, give-up, requeue, finish), for all of the above;
- membership.py: replicas joining, and leaving with their work requeued;
- control.py (weights.py, sleep.py), digests.py, adoption.py, sessions.py, tracing.py: the
  fleet's weights and sleep, weights digests, a predecessor router's outputs, session homes,
  and what set_trace records. A request's rules are in validation.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..policy.base import Policy
from ..protocol import RUNNING_MODES, InputError, ModelInfo, Orders, Report
from .adoption import OrphanAdoption
from .batches import Batches
from .control import FleetControl
from .counters import RouterCounters, RouterMetrics
from .digests import FleetDigests
from .dispatch import Dispatcher
from .fleet import Fleet
from .intake import BatchIntake, NoLiveReplicaError  # noqa: F401  (callers import the error from here)
from .limits import BatchLimits
from .membership import Membership
from .moves import SeqMoves
from .outbox import Outbox
from .reports import ReportApplier
from .sessions import SessionHomes
from .sleep import FleetSleep
from .state import ClusterView, ReplicaState, SeqState, WorkQueue
from .tracing import RouterTrace
from .weights import FleetWeights

# Orders.stop for a replica declared stalled (check_stalls); its health check then fails with it.
STALLED = ("stalled: no new token for router.stall_timeout_s while holding running sequences; "
           "they continue elsewhere from their last reported tokens")


@dataclass
class Applied:
    """What applying one report changed, so that the caller wakes whoever waits for it."""

    replica_id: Optional[str]  # the replica, registered; None: the report was ignored (it had left)
    finished: bool = False  # sequences finished: their drivers' fetches have news
    requeued: bool = False  # work went back to the queue: held pulls can take it
    left: bool = False  # the replica said goodbye; its work is back in the queue
    stalled: bool = False  # the replica was declared stalled (now or before): answer with Orders.stop


class RouterCore:
    def __init__(self, policy: Policy, expected_replicas: int = 1, replica_timeout_s: float = 60.0,
                 metrics: Optional[RouterMetrics] = None, record_tokens: bool = True, trace: bool = False,
                 id_prefix: str = "", limits: Optional[BatchLimits] = None, id_salt=None,
                 max_sessions: int = 65536, stall_timeout_s: float = 0.0, engine_error_retries: int = 2):
        self.id_prefix = id_prefix  # this router's batch and sequence ids start with it
        self.metrics = metrics or RouterMetrics()
        # Plain state the components share (each gets what it needs, no component gets the core).
        self.counters = RouterCounters()
        self.queue = WorkQueue()
        self.seqs: dict[str, SeqState] = {}  # seq_id -> state, every unfinished sequence of every batch
        self.batches = Batches(id_prefix, id_salt)  # id_salt: () -> 16 hex digits of a batch id (Serve: random)
        self.fleet = Fleet(expected_replicas, replica_timeout_s)
        self.outbox = Outbox()
        # The parts, in the order they depend on each other.
        self.weights = FleetWeights()
        self.sleep = FleetSleep()
        self.control = FleetControl(self.weights, self.sleep, self.fleet, self.outbox, self.seqs, id_prefix)
        self.digests = FleetDigests(self.fleet, self.outbox, self.weights, self.sleep, id_prefix)  # weights_digest
        self.sessions = SessionHomes(max_sessions)  # multi-turn sessions' home replicas (affinity)
        self.moves = SeqMoves(self.seqs, self.queue, self.batches, self.fleet, self.outbox, self.weights,
                              self.sessions, self.counters, self.metrics)
        self.adoption = OrphanAdoption(self.moves, self.fleet, self.outbox, self.counters, self.metrics, record_tokens,
                                       id_prefix)
        self.dispatcher = Dispatcher(policy, self.seqs, self.queue, self.batches, self.fleet, self.outbox,
                                     self.control, self.weights, self.moves, self.counters, self.metrics)
        self.tracing = RouterTrace([] if trace else None)  # what a driver's set_trace records
        self.reports = ReportApplier(self.seqs, self.control, self.moves, self.adoption, self.outbox, self.tracing,
                                     self.counters, record_tokens, engine_error_retries)
        self.membership = Membership(self.fleet, stall_timeout_s, self.queue, self.outbox, self.moves,
                                     self.dispatcher, self.adoption, self.weights, self.sleep, self.digests,
                                     self.counters, self.metrics, self.control)
        self.intake = BatchIntake(limits or BatchLimits(), self.seqs, self.queue, self.batches, self.fleet,
                                  self.membership, self.control, self.weights, self.sleep, self.sessions,
                                  self.adoption, self.moves, self.counters, self.metrics, record_tokens)

    # ---- a replica's pull: apply its report, decide, hand it its orders ------------------------------
    def on_report(self, report: Report, now: float, timer=None) -> Orders:
        """A replica's pull: apply its report, then decide; returns its orders."""
        applied = self.apply(report, now)
        if applied.stalled:
            return Orders(stop=STALLED)
        if applied.replica_id is None or applied.left:
            return Orders()
        orders = self.decide(applied.replica_id, now, timer)
        self.trace_pull(applied.replica_id, now)
        return orders

    def trace_pull(self, replica_id: str, now: float) -> None:
        """While tracing: (time, replica, sequences it holds) once per pull, after its decision."""
        rep = self.fleet.replicas.get(replica_id)
        if rep is not None:
            self.tracing.pull(now, replica_id, len(rep.seqs))

    def apply(self, report: Report, now: float) -> Applied:
        """Take in a replica's report: who it is, where its engine is, what it generated, what it holds."""
        self.weights.floor.began(now)  # (a fresh router's start, for weights orders: weights_floor.py)
        if self.fleet.gone(report):  # (a stalled one's reports are never applied: its work runs elsewhere)
            return Applied(None, stalled=self.fleet.was_stalled(report))
        finished, pushed = self.moves.finished_count, self.queue.pushed
        rep = self.membership.register(report, now)
        # (a report the router processed late, after a newer one: what it lists is older than what was sent since)
        fresh = not report.number or report.number > rep.last_report_number
        self.reports.engine_state(rep, report, now)
        if report.digest is not None:
            self.digests.record(rep.replica_id, report.digest)
        self.reports.progress(rep, report, now)
        stalled = False
        if report.leaving:
            self.membership.remove(rep.replica_id, now, leaving=not report.engine_dead, goodbye=True)
        elif self.membership.stalls(rep, now):
            self.membership.remove(rep.replica_id, now, stalled=True)
            stalled = True
        elif report.listing is not None:
            self.reports.reconcile(rep, report.listing.held, report.listing.aborting, now, fresh)
        return Applied(rep.replica_id, self.moves.finished_count != finished, self.queue.pushed != pushed,
                       report.leaving, stalled)

    def decide(self, replica_id: str, now: float, timer=None) -> Orders:
        """The policy's decision at this replica's pull; returns the orders waiting for it."""
        return self.dispatcher.decide(replica_id, now, timer)

    def view(self, now: float) -> ClusterView:
        """What the policy sees; a replica without the current weights, or not awake, is not part of it."""
        return self.dispatcher.view(now)

    # ---- replicas leaving (membership.py) and the fleet's size --------------------------------------
    def expire(self, now: float) -> list:
        """Declare replicas that stopped pulling dead (their work requeued); returns their ids. Drop
        the outputs of a predecessor's segments nobody came back for."""
        self.weights.floor.began(now)
        dead = self.membership.expire(now)
        self.adoption.expire(now)
        return dead

    def check_stalls(self, now: float) -> list:
        """Declare stalled the replicas that hold running sequences and reported no new token for
        stall_timeout_s (an engine paused or hung under a replica that still pulls): their sequences
        continue elsewhere from their last reported tokens, and their further pulls are answered
        with Orders.stop (the replica then fails its health check). Returns their ids."""
        return self.membership.check_stalls(now)

    def remove_replica(self, replica_id: str, now: float, leaving: bool = False, goodbye: bool = False,
                       stalled: bool = False) -> None:
        """Take a replica out of the fleet, its sequences requeued (membership.py says how)."""
        self.membership.remove(replica_id, now, leaving, goodbye, stalled)

    def set_fleet_target(self, replicas: int, now: float) -> None:
        """A driver told Serve to run `replicas` (RolloutClient.scale): Fleet.set_target."""
        self.fleet.set_target(replicas, now)

    # ---- a driver's batches (intake.py) ---------------------------------------------------------------
    def submit(self, requests: list, now: float, batch_id: Optional[str] = None,
               weights_version: Optional[int] = None, previous_ids: Optional[list] = None) -> str:
        """Queue a batch of SequenceRequests; returns its id. Invalid ones finish at once with an
        error; what would fail the whole batch refuses it before anything is registered (intake.py)."""
        return self.intake.submit(requests, now, batch_id, weights_version, previous_ids)

    def fetch(self, batch_id: str, cursor: int, now: Optional[float] = None) -> tuple:
        """(completions finished since `cursor`, new cursor, batch done). A retry gets the same
        answer, the last one too; a fetch from the end of a finished batch releases it (batches.py)."""
        return self.batches.fetch(batch_id, cursor, now)

    def cancel(self, batch_id: str, now: float) -> int:
        """Stop a batch (the driver timed out or gave up): queued sequences finish as "abort"
        at once, running ones when their replica confirms the give-up. Returns how many."""
        return self.intake.cancel(batch_id, now)

    def drop_abandoned(self, now: float, idle_s: float) -> list:
        """Cancel and forget every batch nobody fetched from for `idle_s` seconds; returns their ids."""
        return self.intake.drop_abandoned(now, idle_s)

    def drop_finished(self, now: float, keep_s: float) -> list:
        """Forget every batch fetched whole more than `keep_s` ago whose driver never fetched from
        its end (router.finished_batch_keep_s); returns their ids."""
        gone = self.batches.finished_unacknowledged(now, keep_s)
        for bid in gone:
            self.batches.drop_finished(bid, now)
        return gone

    def release(self, batch_id: str) -> None:
        """The driver fetched the whole batch: forget it."""
        self.batches.release(batch_id)

    # ---- the fleet's weights and sleep (control.py), between batches ---------------------------------
    def update_weights(self, path: str, version: Optional[int] = None, buckets: Optional[tuple] = None,
                       running: str = "finish", now: Optional[float] = None, total: Optional[int] = None) -> int:
        """Point every replica at the checkpoint in `path` as `version` (default: current + 1, and
        above every version a replica reported; a fresh router refuses the order, WeightsNotLearned
        and retryable, until it heard every replica or a replica timeout passed: weights_floor.py);
        with `buckets`, at a push's tensors (push_weights), `path` naming the push. `running` says
        what becomes of the sequences that run now (RUNNING_MODES): "finish" refuses while any is
        unfinished (the driver waits first); "keep" swaps the weights between engine steps under
        the running ones, which continue on the KV cache they have (each one's weight_versions
        gets the token where its engine swapped, from the replica's report); "recompute" gives the
        running ones up and continues them on the new weights by re-prefill (exact: the tokens
        after the swap are the new weights' continuation); "abort" ends them as "abort" with their
        tokens (partial rollouts). Queued sequences run on the new weights in every mode. `total`:
        a streamed push's objects in all, the rest following with push_more (abort_push until then)."""
        if running not in RUNNING_MODES:
            raise InputError("running", running, f"must be one of {', '.join(RUNNING_MODES)}")
        in_flight = running != "finish"
        v = self.control.update_weights(path, version, buckets, in_flight=in_flight, keep=running == "keep", now=now,
                                        total=total)
        if in_flight:
            self.moves.take_back_unsent()  # Work still in an outbox runs on the new weights, as queued work
            if running != "keep":
                self.moves.give_up_running(abort=running == "abort")
        return v

    def abort_push(self, source: str, reason: str, now: float = 0.0) -> dict:
        """Its trainer aborted the streamed push `source` before all its objects came: the fleet
        goes back to the version before it (control.abort_push). The batches opened on the aborted
        version, none of whose sequences ran (no replica could hold it), run on the version gone
        back to; those whose driver named the aborted version fail (WeightsVersionError's words), as
        a batch naming a version the fleet is not at is refused. {"aborted": the aborted version or
        None (nothing to abort: not a push still coming), "version": the fleet's version now}."""
        aborted = self.control.abort_push(source, reason)
        if aborted is not None:
            self.moves.after_push_abort(aborted, source, reason, now)
        return {"aborted": aborted, "version": self.weights.version}

    def sleep_fleet(self, level: int = 1) -> int:
        """Put every engine to sleep at vLLM's `level`; a batch submitted before wake() is refused."""
        return self.control.sleep_fleet(level)

    def wake_fleet(self) -> None:
        """Wake every engine (a level-2 sleeper reloads the current weights first)."""
        self.control.wake_fleet()

    def reset_prefix_cache(self) -> int:
        """Order every engine to drop its prefix cache; returns how many replicas were ordered."""
        return self.control.reset_prefix_cache()

    def weights_status(self) -> dict:
        return self.weights.status(self.fleet.replicas)

    def weights_learned(self, weights_version: Optional[int], now: float) -> bool:
        """Whether a batch (pinned to `weights_version`, or None) may be taken now on what this
        router knows of the fleet's weights. A fresh (or restarted) router learns the version from
        the replicas' reports until the first batch: taken before it heard every replica it
        expects (weights_floor.py), a batch could fix the version of the first replica to report,
        one whose last load failed, and send the fleet back to weights the others replaced. The
        Serve router waits a few seconds for this, then takes the batch anyway."""
        w = self.weights
        return not w.learning_below(weights_version) and (
            not w.learning or w.floor.hear(self.fleet.expected, now, self.fleet.replica_timeout_s))

    def sleep_status(self) -> dict:
        return self.sleep.status()

    def usable(self, rep: ReplicaState) -> bool:
        """It may get work: it holds the current weights, loads no others, and is awake."""
        return self.control.usable(rep)

    # ---- state the Serve router and the simulator read (and set_policy, set_trace reset) ----------------
    @property
    def policy(self) -> Policy:
        """The policy that decides at every pull (dispatch.py); set_policy replaces it between batches."""
        return self.dispatcher.policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        self.dispatcher.policy = policy

    @property
    def model(self) -> Optional[ModelInfo]:
        """The model the first replica said it runs (membership.py); requests are checked against it."""
        return self.membership.model

    @property
    def stall_timeout_s(self) -> float:
        """A replica holding running sequences with no new token for this long is stalled (0: never)."""
        return self.membership.stall_timeout_s

    @property
    def decision_times(self) -> list:
        """Seconds per policy decision, while the driver passes a timer (a recent window)."""
        return self.dispatcher.decision_times

    @property
    def trace(self) -> Optional[list]:
        """(time, replica_id, sequences held) per pull; None: not tracing."""
        return self.tracing.pulls

    @trace.setter
    def trace(self, pulls: Optional[list]) -> None:
        self.tracing.pulls = pulls

    @property
    def step_samples(self) -> list:
        return self.tracing.step_samples

    @step_samples.setter
    def step_samples(self, samples: list) -> None:
        self.tracing.step_samples = samples
