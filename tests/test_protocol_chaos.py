"""Chaos test of the router's pull protocol: RouterCore driven in virtual time over fake replicas.

Each fake replica wraps a SimEngineCore and does what serve/replica.py's pull loop does: it
drains the engine, keeps every delta until a pull succeeds (and sends it again after a failed
one), lists the attempts it holds (and those whose abort is on its way) every HELD_EVERY_S, paces
its reports like `_pace`, starts and gives up what it is told, and on a graceful shutdown hands
its work back in a last report marked `leaving`. A seeded random.Random injects, per case:
- a reply lost (the router applied the report and answered; the orders never arrive);
- a report lost before the router applies it (the replica keeps its deltas and sends them again);
- a report delivered twice (the router applies it twice; only one of the two answers arrives);
- a give-up whose abort lands late (listed in `aborting` meanwhile, like vLLM's async abort);
- a replica that dies silently (expired after replica_timeout_s); one whose pulls all fail for
  longer than the timeout and that then comes back with the same incarnation; one that restarts
  (new incarnation, engine state lost); one whose engine dies (goodbye marked engine_dead); a
  graceful leave (partials handed back; sometimes the goodbye itself is lost); replicas joining;
- several batches submitted at different times, a driver cancel of one of them, fetches at random
  times with the cursor, and sometimes again from an earlier cursor (a retried fetch).
Under the steal, pull, least-loaded, chunked and scripted policies, it asserts:
1. every sequence of every batch comes back from fetch exactly once, and a fetch from an earlier
   cursor returns the same completions in the same order;
2./3. a sequence not cancelled ends "length" with exactly min(hidden_length, max_tokens) tokens,
   and they are those of an unmigrated, fault-free run: SimEngineCore emits the contiguous run
   (hash(seq_id) + prompt_len + i) % vocab, so no token was lost, repeated or reordered;
4. a cancelled one ends "abort" with a prefix of that run (or "length" with all of it: it ended
   before the cancel reached it);
5. logprobs, when asked for, come one per token (and not at all otherwise);
6. migrations' at_token never decreases and stays within the tokens; a finished sequence's every
   migration names a replica it ran on as destination;
7. once fetched and released, the router holds nothing of the batches, and after a calm period
   without faults no engine still runs an attempt (orphans were given up);
8. every answer's Work is the current attempt of its sequence on that replica, and every give-up
   names an attempt being given up there or one the router does not know (an orphan).
The bugs it found, now fixed, are at the end as focused tests. The token check is shown to fail on corrupted
runs (test_the_token_check_catches_...); removing the router's duplicate-offset check, its stale-
report check or its reconciliation (tried by hand) makes most random cases fail.
"""
from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field, replace
from typing import Optional

import pytest

from rollout_cluster.config import URGENT_REPORT_GAP_FRAC, PolicyConfig, RouterConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.engines.sim_core import SimEngineCore
from rollout_cluster.policy import make_policy
from rollout_cluster.router_core import RouterCore
from rollout_cluster.state import SeqStatus
from rollout_cluster.types import Completion, EngineStats, ModelInfo, Report, SamplingSpec, SequenceRequest

VOCAB = 4093  # prime, above any run's length (a repeat is never a full period); runs still wrap around it
CAPACITY = 4  # small: work queues at the router, so continuations and pushes to busy replicas happen
COST = load_profile("h200-1.5b", max_num_seqs=CAPACITY)
# For steal: a move must repay its re-prefill 20 times over (steal.REPAY_FACTOR) and shorten the
# victim's finish, which at 2 ms a step and a per-sequence cost of 20 us needs thousands of tokens
# and large batches. Here a step costs mostly per sequence: stacked long sequences pay off moving.
STEAL_COST = replace(COST, name="chaos-per-sequence", a=2e-3, c=0.0, e=4e-3, prefill_tokens_per_s=100_000)
MODEL = ModelInfo(VOCAB, 4096, "sim:chaos")
ROUTER = RouterConfig()
HELD_EVERY_S = 2.0  # serve/replica.py's HELD_EVERY_S (not imported: that module imports ray)
RETRY_S = 0.5  # serve/replica.py sleeps this long after a failed pull
REPLICA_TIMEOUT_S = 5.0
EXPIRE_EVERY_S = 0.5  # the Serve router's housekeeping calls expire about this often
MAX_VIRTUAL_S = 600.0  # the batches must be done by then
CALM_S = 10.0  # after the batches: no faults, so that reconciliation can clean the engines up

POLICIES = {
    # steal with low thresholds, so that these small batches migrate
    "steal": PolicyConfig(name="steal", min_gain_s=0.05, min_gain_frac=0.01, min_move_interval_s=0.3,
                          max_reprefill_frac=0.5),
    "pull": PolicyConfig(name="pull"),
    "least-loaded": PolicyConfig(name="least-loaded"),
    "chunked": PolicyConfig(name="chunked", chunk_tokens=40),
    "scripted": PolicyConfig(name="scripted", scripted_at_tokens=[3, 17, 60]),
}


# ---- the fake replica ---------------------------------------------------------------------------
class FakeReplica:
    """serve/replica.py's pull loop around a SimEngineCore, in virtual time. The harness moves it
    from event to event; it never talks to the router itself.

    Simplifications: one pull at a time and no transport delay; `_pace`'s 10 ms ticks are exact
    (the engine runs to the moment a segment ends, and may end a step past a deadline); a leave
    or an engine death shows at the replica's next pull, not within a tick; control orders
    (weights, sleep) are not used; the engine's own abort is immediate (SimEngine's is), and a
    "late" one, as vLLM's async abort, lands at the replica's next report or the one after."""

    def __init__(self, rid: str, incarnation: str, t: float, cost=COST):
        self.rid, self.incarnation = rid, incarnation
        self.engine = SimEngineCore(cost, vocab_size=VOCAB)
        self.clock = t  # the engine's virtual time (it can run a step ahead of the harness)
        self.unsent: list = []  # deltas drained and not yet delivered: sent again after a failed pull
        self.first = True  # replica.py sends its ModelInfo on the first pull after a failure
        self.held_t = -math.inf
        self.pending_aborts: set = set()  # given up, abort not landed yet (engine.aborting())
        self.stopping = False  # Serve is shutting it down: hand back at the next loop turn
        self.engine_dead = False
        self.gone = False  # no longer runs (dead, restarted, left)
        self.stalled_until = -math.inf  # its pulls fail until then (a partition, a long pause)

    def held(self) -> list:
        e = self.engine
        return [(s.work.seq_id, s.work.attempt) for group in (e.running, e.waiting) for s in group]

    def aborting(self) -> list:
        return [k for k in self.held() if k in self.pending_aborts]

    def advance_to(self, t: float) -> None:
        e = self.engine
        while not self.engine_dead and self.clock < t and e.busy:
            dt = e.advance(limit_s=t - self.clock)
            if dt <= 0:
                break
            self.clock += dt
        self.clock = max(self.clock, t)

    def land_aborts(self) -> None:
        if self.pending_aborts:
            self.engine.abort(self.pending_aborts)
            self.pending_aborts = set()

    def build_report(self, t: float, land_aborts: bool) -> tuple:
        """The loop's top: drain, list what is held every HELD_EVERY_S. Returns (report, ended)."""
        if land_aborts:
            self.land_aborts()
        ended = self.engine.ended  # before the drain, as replica.py reads it
        self.unsent += self.engine.drain()
        held, aborting = None, []
        if t - self.held_t >= HELD_EVERY_S:  # drained and listed together: consistent
            held, aborting, self.held_t = self.held(), self.aborting(), t
        report = Report(self.rid, self.incarnation, list(self.unsent), self.stats(), MODEL if self.first else None,
                        CAPACITY, held=held, aborting=aborting)
        return report, ended

    def stats(self) -> EngineStats:
        e = self.engine
        return EngineStats(running=len(e.running), waiting=len(e.waiting), context_tokens=e.context,
                           step_time_s=e.last_step_s)

    def apply(self, orders, late_abort: bool) -> None:
        for work in orders.start:
            self.engine.submit(work)
        if orders.give_up:
            if late_abort:
                self.pending_aborts.update(orders.give_up)
            else:
                self.engine.abort(orders.give_up)
        self.pending_aborts &= set(self.held())  # a give-up of what already ended is a no-op

    def pace(self, reported_t: float, ended: int, urgent: bool, interval: float) -> float:
        """replica.py `_pace`: when the next pull goes out (the engine runs until then)."""
        if self.stopping or self.engine_dead or not self.held():
            return self.clock  # an idle replica pulls again at once; a stopping one hands back now
        deadline, urgent_from = reported_t + interval, reported_t + URGENT_REPORT_GAP_FRAC * interval
        e = self.engine
        while self.clock < deadline:
            if e.ended != ended:
                if not self.held():
                    return self.clock
                if urgent and self.clock >= urgent_from:
                    return self.clock
            target = urgent_from if urgent and e.ended != ended else deadline
            if not e.busy:
                self.clock = target
                continue
            dt = e.advance(limit_s=target - self.clock)
            if dt <= 0:
                break
            self.clock += dt
        return max(self.clock, deadline)

    def hand_back(self) -> Report:
        """replica.py `_hand_back`: give up everything, drain the partials, say goodbye."""
        held = self.held()
        if held:
            self.engine.abort(held)
        self.pending_aborts = set()
        self.unsent += self.engine.drain()
        return Report(self.rid, self.incarnation, list(self.unsent), self.stats(), None, CAPACITY, leaving=True)

    def dead_engine_goodbye(self) -> Report:
        """replica.py `_leave_dead_engine`: the tokens made since the last report, no finals."""
        self.unsent += self.engine.drain()
        return Report(self.rid, self.incarnation, list(self.unsent), self.stats(), None, CAPACITY,
                      leaving=True, engine_dead=True)


# ---- faults, batches ----------------------------------------------------------------------------
FLEET_EVENTS = ("die", "stall", "restart", "engine_death", "leave", "join")
SHRINKING = ("die", "engine_death", "leave")  # permanent: only while another replica stays


@dataclass
class Faults:
    lost_reply: float = 0.0
    lost_report: float = 0.0
    duplicate: float = 0.0
    late_abort: float = 0.0
    lost_goodbye: float = 0.0
    fleet: list = field(default_factory=list)  # (time, kind)
    cancel: bool = False

    @classmethod
    def draw(cls, rng: random.Random) -> "Faults":
        fleet = sorted((rng.uniform(0.2, 6.0), rng.choice(FLEET_EVENTS)) for _ in range(rng.randint(1, 5)))
        return cls(lost_reply=rng.uniform(0, 0.15), lost_report=rng.uniform(0, 0.15), duplicate=rng.uniform(0, 0.1),
                   late_abort=rng.uniform(0, 0.6), lost_goodbye=rng.uniform(0, 0.5), fleet=fleet,
                   cancel=rng.random() < 0.7)


@dataclass
class Batch:
    requests: list
    submit_t: float
    bid: Optional[str] = None
    seq_ids: dict = field(default_factory=dict)  # index -> seq_id
    got: dict = field(default_factory=dict)  # index -> Completion
    order: list = field(default_factory=list)  # indexes in the order fetch returned them
    cursor: int = 0
    cancelled: bool = False
    released: bool = False


def random_requests(rng: random.Random, n_prompts: int, max_samples: int) -> list:
    """Prompts of 1-`max_samples` samples with varied ends; the first two prompts' samples are a
    long tail (what steal moves: STEAL_COST)."""
    out = []
    for p in range(n_prompts):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 40))]
        max_tokens = rng.randint(600, 1500) if p < 2 else rng.randint(20, 300)
        spec = SamplingSpec(max_tokens=max_tokens, logprobs=rng.choice([None, 0]))
        for s in range(max_samples if p < 2 else rng.randint(1, max_samples)):
            hidden = rng.randint(1, int(spec.max_tokens * 1.2))  # some run into max_tokens
            out.append(SequenceRequest(prompt, spec, p, s, hidden_length=hidden))
    return out


# ---- the harness --------------------------------------------------------------------------------
class Chaos:
    """The router, a fleet of FakeReplicas and a driver, moved event by event in virtual time."""

    def __init__(self, policy: str, seed: int, faults: Faults, replicas: int, batches: list):
        self.rng = random.Random(seed)
        self.faults = faults
        self.cost = STEAL_COST if policy == "steal" else COST
        self.core = RouterCore(make_policy(POLICIES[policy], self.cost), expected_replicas=replicas,
                               replica_timeout_s=REPLICA_TIMEOUT_S)
        self.events: list = []
        self._n = itertools.count()
        self._incarnations = itertools.count()
        self._joins = itertools.count()
        self.fleet: dict = {}  # replica_id -> its current FakeReplica
        self.batches = batches
        self.calm = False
        self.now = 0.0
        self.superseded: list = []  # (t, replica, seq_id, attempt, the router's (attempt, replica, status))
        self.fleet_log: list = []  # (t, kind, replica) of the fleet events that happened
        for i in range(replicas):
            self._start_replica(f"r{i}", self.rng.uniform(0.0, 0.02))
        for b in batches:
            self.schedule(b.submit_t, self._submit, b)
        for t, kind in faults.fleet:
            self.schedule(t, self._fleet_event, kind)
        if faults.cancel and len(batches) > 1:
            b = self.rng.choice(batches)
            self.schedule(b.submit_t + self.rng.uniform(0.05, 3.0), self._cancel, b)
        self.schedule(0.1, self._fetch_some)
        self.schedule(EXPIRE_EVERY_S, self._expire)

    # -- plumbing
    def answer(self, rep: "FakeReplica", orders):
        """Check an answer as the router gives it: each Work is the current attempt of its sequence
        on this replica (the router must not send what it already took for lost); each give-up
        names an attempt that is being given up here, or one the router does not know (an orphan)."""
        for w in orders.start:
            seq = self.core.seqs.get(w.seq_id)
            if seq is None or (seq.attempt, seq.replica) != (w.attempt, rep.rid):
                self.superseded.append((round(self.now, 3), rep.rid, w.seq_id, w.attempt,
                                        None if seq is None else (seq.attempt, seq.replica, seq.status.value)))
        for seq_id, attempt in orders.give_up:
            seq = self.core.seqs.get(seq_id)
            if seq is not None and (seq.attempt, seq.replica) == (attempt, rep.rid):
                assert seq.status is SeqStatus.GIVING_UP, f"give-up of {seq_id}/{attempt}, {seq.status}"
        return orders

    def schedule(self, t: float, handler, *args) -> None:
        heapq.heappush(self.events, (t, next(self._n), handler, args))

    def chance(self, p: float) -> bool:
        return not self.calm and self.rng.random() < p

    def live(self) -> list:
        return [r for r in self.fleet.values() if not (r.gone or r.stopping or r.engine_dead)]

    def _start_replica(self, rid: str, t: float) -> FakeReplica:
        rep = FakeReplica(rid, f"{rid}-i{next(self._incarnations)}", t, self.cost)
        self.fleet[rid] = rep
        self.schedule(t, self._pull, rep)
        return rep

    def run(self) -> None:
        while not all(b.released for b in self.batches):
            self._step(MAX_VIRTUAL_S, self._stuck)
        self.calm = True
        for rep in self.fleet.values():
            rep.stalled_until = -math.inf
        end = self.now + CALM_S
        while self.events[0][0] <= end:
            self._step(end, None)

    def _step(self, limit: float, on_limit) -> None:
        t, _, handler, args = heapq.heappop(self.events)
        if t > limit and on_limit is not None:
            on_limit()
        self.now = t
        handler(t, *args)

    def _stuck(self) -> None:
        left = {b.bid: len(b.requests) - len(b.got) for b in self.batches if not b.released}
        raise AssertionError(f"batches not done after {MAX_VIRTUAL_S:.0f} virtual s: unfetched per batch {left}; "
                             f"router seqs {[(s.seq_id, s.status.value, s.replica) for s in self.core.seqs.values()]}; "
                             f"replicas {sorted(self.core.replicas)}; counters {self.core.counters}")

    # -- replica side
    def _pull(self, t: float, rep: FakeReplica) -> None:
        if rep.gone:
            return
        rep.advance_to(t)
        if rep.engine_dead:
            return self._goodbye(t, rep, rep.dead_engine_goodbye())
        if rep.stopping:
            return self._goodbye(t, rep, rep.hand_back())
        report, ended = rep.build_report(t, land_aborts=self.rng.random() < 0.7)
        if t < rep.stalled_until or self.chance(self.faults.lost_report):
            return self._pull_failed(t, rep)
        orders = self.answer(rep, self.core.on_report(report, t))
        if self.chance(self.faults.duplicate):  # delivered twice: one of the two answers comes back
            again = self.answer(rep, self.core.on_report(report, t))
            if self.rng.random() < 0.5:
                orders = again
        if orders:
            return self._reply(t, rep, orders, t, ended)
        # The router holds an empty pull (serve/router.py) and decides again when it lets it go.
        # Simplification: the hold lasts a random part of its wait; new work does not wake it.
        state = self.core.replicas.get(rep.rid)
        busy = state is not None and len(state.seqs) > 0
        wait = ROUTER.pull_wait_s if busy or len(self.core.queue) else ROUTER.idle_pull_wait_s
        self.schedule(t + self.rng.uniform(0.0, wait), self._reply, rep, None, t, ended)

    def _pull_failed(self, t: float, rep: FakeReplica) -> None:
        rep.first = True  # replica.py: keep the deltas, sleep, send the model again
        self.schedule(t + RETRY_S, self._pull, rep)

    def _reply(self, t: float, rep: FakeReplica, orders, reported_t: float, ended: int) -> None:
        if orders is None:  # a held pull ends: the router decides, whether anybody still listens or not
            orders = self.answer(rep, self.core.decide(rep.rid, t))
        if rep.gone:
            return
        if t < rep.stalled_until or self.chance(self.faults.lost_reply):
            return self._pull_failed(t, rep)
        rep.unsent, rep.first = [], False
        if rep.engine_dead:  # the orders meet a dead engine: it says goodbye at once
            return self.schedule(t, self._pull, rep)
        rep.advance_to(t)
        rep.apply(orders, late_abort=self.chance(self.faults.late_abort))
        urgent = orders.work_waiting or bool(orders.give_up) or bool(rep.aborting())
        interval = orders.report_interval_s or ROUTER.report_interval_s
        self.schedule(rep.pace(reported_t, ended, urgent, interval), self._pull, rep)

    def _goodbye(self, t: float, rep: FakeReplica, report: Report) -> None:
        rep.gone = True
        if t < rep.stalled_until or self.chance(self.faults.lost_goodbye):
            return  # the router finds out after replica_timeout_s instead
        orders = self.core.on_report(report, t)
        assert not orders, f"a leaving replica was given orders: {orders}"

    def _fleet_event(self, t: float, kind: str) -> None:
        if self.calm:
            return
        live = self.live()
        if kind in SHRINKING and len(live) < 2 or not live:
            kind = "join"
        if kind == "join":
            rid = f"j{next(self._joins)}"
            self.fleet_log.append((t, kind, rid))
            self._start_replica(rid, t)
            return
        rep = self.rng.choice(live)
        rep.advance_to(t)
        self.fleet_log.append((t, kind, rep.rid))
        if kind == "die":
            rep.gone = True
        elif kind == "stall":
            rep.stalled_until = t + REPLICA_TIMEOUT_S + self.rng.uniform(0.5, 2.0)
        elif kind == "restart":
            rep.gone = True
            self._start_replica(rep.rid, t + self.rng.uniform(0.1, 1.0))
        elif kind == "engine_death":
            rep.engine_dead = True
        elif kind == "leave":
            rep.stopping = True

    # -- driver side
    def _submit(self, t: float, b: Batch) -> None:
        if not self.core.replicas:  # (RolloutClient waits for a replica too)
            return self.schedule(t + 0.2, self._submit, b)
        b.bid = self.core.submit(b.requests, t)
        b.seq_ids = {s.index: s.seq_id for s in self.core.seqs.values() if s.batch_id == b.bid}
        assert len(b.seq_ids) == len(b.requests)

    def _cancel(self, t: float, b: Batch) -> None:
        if b.bid is None:
            return self.schedule(t + 0.2, self._cancel, b)
        b.cancelled = True
        self.core.cancel(b.bid, t)

    def _fetch_some(self, t: float) -> None:
        open_ = [b for b in self.batches if b.bid is not None and not b.released]
        if open_:
            fetch_batch(self.core, self.rng.choice(open_), t, self.rng)
        self.schedule(t + self.rng.uniform(0.1, 1.5), self._fetch_some)

    def _expire(self, t: float) -> None:
        self.core.expire(t)
        self.schedule(t + EXPIRE_EVERY_S, self._expire)


def fetch_batch(core: RouterCore, b: Batch, t: float, rng: random.Random) -> None:
    """A driver's fetch from its cursor; sometimes first a retried fetch from an earlier cursor,
    which must give the same completions in the same order."""
    if b.cursor and rng.random() < 0.3:
        old = rng.randrange(b.cursor)
        again, _, _ = core.fetch(b.bid, old, t)
        assert [c.index for c in again[:b.cursor - old]] == b.order[old:b.cursor], "a re-fetch differs"
    new, cursor, done = core.fetch(b.bid, b.cursor, t)
    for c in new:
        assert c.index not in b.got, f"{b.bid} index {c.index} fetched twice"
        b.got[c.index] = c
        b.order.append(c.index)
    assert cursor == len(b.order)
    b.cursor = cursor
    if done:
        core.release(b.bid)
        b.released = True


# ---- invariants ---------------------------------------------------------------------------------
def expected_run(seq_id: str, req: SequenceRequest) -> list:
    """The tokens an unmigrated, fault-free SimEngineCore run of the request gives."""
    length = min(req.hidden_length, req.sampling.max_tokens)
    base = hash(seq_id) % VOCAB
    return [(base + req.prompt_len + i) % VOCAB for i in range(length)]


def first_difference(got: list, want: list) -> str:
    i = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return f"first difference at token {i} of {len(got)} (want {len(want)}): got {got[i:i + 5]}, want {want[i:i + 5]}"


def check_completion(c: Completion, seq_id: str, req: SequenceRequest, cancelled: bool) -> None:
    want, got = expected_run(seq_id, req), list(c.token_ids)
    where = f"{seq_id} ({c.finish_reason}, migrations {c.migrations})"
    if c.finish_reason == "abort":
        assert cancelled, f"{where}: aborted, but its batch was not cancelled"
        assert got == want[:len(got)], f"{where}: not a prefix of its run: {first_difference(got, want)}"
    else:
        assert c.finish_reason == "length", f"{where}: finish_reason {c.finish_reason!r}, error {c.error!r}"
        assert got == want, f"{where}: {first_difference(got, want)}"
    if req.sampling.logprobs is None:
        assert c.logprobs is None, f"{where}: logprobs it did not ask for"
    else:
        assert c.logprobs is not None and len(c.logprobs) == len(got), f"{where}: logprobs do not match the tokens"
    check_migrations(c, where, finished=c.finish_reason != "abort")


def check_migrations(c: Completion, where: str, finished: bool) -> None:
    at = [m.at_token for m in c.migrations]
    assert at == sorted(at) and all(0 <= a <= len(c.token_ids) for a in at), f"{where}: migrations' at_token {at}"
    assert all(m.reason in ("policy", "replica_left", "replica_lost") for m in c.migrations), where
    assert all(m.source in c.replicas for m in c.migrations), f"{where}: ran on {c.replicas}"
    if finished:  # it continued after every boundary, somewhere it ran
        assert all(m.destination in c.replicas for m in c.migrations), f"{where}: ran on {c.replicas}"


def check_batches(batches: list) -> None:
    for b in batches:
        assert b.released and sorted(b.got) == list(range(len(b.requests))), f"{b.bid}: fetched {sorted(b.got)}"
        for i, c in b.got.items():
            assert (c.batch_id, c.index) == (b.bid, i)
            check_completion(c, b.seq_ids[i], b.requests[i], b.cancelled)


def check_router_holds_nothing(core: RouterCore) -> None:
    assert not core.seqs, f"sequences left: {list(core.seqs)}"
    assert len(core.queue) == 0 and not core.queue.reserved
    assert all(len(r.seqs) == 0 for r in core.replicas.values()), {r: list(s.seqs) for r, s in core.replicas.items()}
    assert not core.give_up_t and not core.batches and not core.groups


def check_engines_idle(chaos: Chaos) -> None:
    for rep in chaos.fleet.values():
        if not rep.gone:
            assert not rep.held(), f"{rep.rid} still runs {rep.held()} (counters {chaos.core.counters})"


class SupersededWork(AssertionError):
    """The router sent a replica work it had already requeued or replaced with a newer attempt."""


def check_no_superseded_work(chaos: Chaos) -> None:
    if chaos.superseded:
        raise SupersededWork(f"{len(chaos.superseded)} Work orders were not the current attempt when sent, "
                             f"(t, replica, seq, attempt sent, router's (attempt, replica, status)): "
                             f"{chaos.superseded[:4]}; counters {chaos.core.counters}")


def run_case(policy: str, seed: int, faults: Optional[Faults] = None, replicas: Optional[int] = None,
             batches: Optional[list] = None) -> Chaos:
    """One randomized scenario, checked end to end (every invariant but superseded work, which
    the caller checks)."""
    rng = random.Random(f"{policy}/{seed}")
    if faults is None:
        faults = Faults.draw(rng)
    if batches is None:
        batches = [Batch(random_requests(rng, rng.randint(3, 8), 3), 0.05 if k == 0 else rng.uniform(0.1, 4.0))
                   for k in range(rng.randint(2, 4))]
    chaos = Chaos(policy, rng.randrange(1 << 30), faults, replicas or rng.randint(3, 6), batches)
    chaos.run()
    check_batches(batches)
    check_router_holds_nothing(chaos.core)
    check_engines_idle(chaos)
    return chaos


# ---- tests --------------------------------------------------------------------------------------
SEEDS = {"steal": 8, "pull": 8, "least-loaded": 8, "chunked": 8, "scripted": 8}


@pytest.mark.parametrize("policy,seed", [(p, s) for p, n in SEEDS.items() for s in range(n)])
def test_random_faults_lose_nothing(policy, seed):
    check_no_superseded_work(run_case(policy, seed))


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_without_faults_nothing_is_lost_or_recovered(policy):
    """The same harness with no fault: nothing is lost, resent, recovered or orphaned."""
    chaos = run_case(policy, 100, Faults())
    check_no_superseded_work(chaos)
    c = chaos.core.counters
    assert (c["lost_orders"], c["orphans_given_up"], c["duplicate_reports"], c["recovered"], c["handed_back"],
            c["stale_reports"]) == (0, 0, 0, 0, 0, 0), c
    if policy in ("steal", "scripted"):
        assert c["migrations"] > 0, c


def test_a_replica_back_after_its_timeout_has_its_old_attempts_given_up():
    """A replica whose pulls fail for longer than replica_timeout_s is declared dead and its work
    continues elsewhere; when it comes back (same incarnation) its engine still runs the old
    attempts: their reports are stale, and two listings later they are given up as orphans."""
    long = [SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=1500, logprobs=0), i, 0, hidden_length=1400 + i)
            for i in range(8)]
    chaos = run_case("steal", 0, Faults(fleet=[(1.0, "stall")]), replicas=2, batches=[Batch(long, 0.05)])
    check_no_superseded_work(chaos)
    c = chaos.core.counters
    assert c["replica_deaths"] == 1 and c["recovered"] == 4 and c["stale_reports"] > 0, c
    assert c["orphans_given_up"] == 4, c
    ((_, _, stalled),) = chaos.fleet_log
    lost = [m for done in chaos.batches[0].got.values() for m in done.migrations if m.reason == "replica_lost"]
    assert len(lost) == 4 and {m.source for m in lost} == {stalled}, lost


def test_the_token_check_catches_a_lost_repeated_or_reordered_token():
    req = SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=50, logprobs=0), 0, 0, hidden_length=30)
    good = expected_run("b0:0", req)
    assert len(good) == 30 and good[0] == (hash("b0:0") + 3) % VOCAB

    def completion(tokens, reason="length"):
        return Completion(0, 0, tokens, [-1.0] * len(tokens), reason, replicas=["a"])

    check_completion(completion(good), "b0:0", req, cancelled=False)
    check_completion(completion(good[:12], "abort"), "b0:0", req, cancelled=True)
    lost, repeated, swapped = good[:10] + good[11:] + [good[-1]], good[:10] + good[9:29], list(good)
    swapped[4], swapped[5] = swapped[5], swapped[4]
    for bad in (lost, repeated, swapped, good[:-1], expected_run("b0:1", req)):
        with pytest.raises(AssertionError):
            check_completion(completion(bad), "b0:0", req, cancelled=False)
    with pytest.raises(AssertionError):
        check_completion(completion(good[1:13], "abort"), "b0:0", req, cancelled=True)
    with pytest.raises(AssertionError):
        check_completion(completion(good[:12], "abort"), "b0:0", req, cancelled=False)
    with pytest.raises(AssertionError):  # a logprob short
        check_completion(Completion(0, 0, good, [-1.0] * 29, "length", replicas=["a"]), "b0:0", req, False)


# ---- bugs this harness found (fixed) ------------------------------------------------------------
def _report(rid: str, held=None, model=None) -> Report:
    return Report(rid, f"{rid}-1", [], EngineStats(), model, CAPACITY, held=held)


def test_work_pushed_to_a_busy_replica_is_not_taken_for_lost():
    """least-loaded puts a requeued sequence in the outbox of b, a busy replica that is not the one
    pulling. b's next pull is a report with its listing: the new attempt is not on it (it has not
    been sent), and the router must not take it for lost."""
    core = RouterCore(make_policy(PolicyConfig(name="least-loaded"), COST), expected_replicas=3, replica_timeout_s=1.0)
    for rid in "abc":
        core.on_report(_report(rid, model=MODEL), 0.0)
    core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=50), i, 0) for i in range(4)], 0.0)
    held = {rid: [(w.seq_id, w.attempt) for w in core.decide(rid, 0.0).start] for rid in "abc"}
    assert held == {"a": [("b0:0", 1), ("b0:3", 1)], "b": [("b0:1", 1)], "c": [("b0:2", 1)]}
    for t in (0.5, 1.0):  # b and c report; a has gone silent
        for rid in "bc":
            core.on_report(_report(rid, held=held[rid]), t)
    assert core.expire(1.2) == ["a"]  # a's two sequences are requeued
    (to_c,) = core.on_report(_report("c", held=held["c"]), 1.3).start  # c (2 running) pulls...
    assert to_c.seq_id == "b0:3" and [(w.seq_id, w.attempt) for w in core.outbox["b"].start] == [("b0:0", 2)]
    # ...and b (1 running) is pushed b0:0 attempt 2. b's next pull reports and lists what it runs:
    orders = core.on_report(_report("b", held=held["b"]), 1.4)
    assert core.counters["lost_orders"] == 0
    assert [(w.seq_id, w.attempt) for w in orders.start] == [("b0:0", 2)]  # one attempt, not also a third


def test_chunked_under_random_faults_sends_only_current_work():
    """chunked pushes each round into outboxes: the case that met the stale pull number most."""
    check_no_superseded_work(run_case("chunked", 1))


def test_a_sequence_cancelled_before_its_first_token_gets_empty_logprobs():
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=1)
    core.on_report(_report("a", model=MODEL), 0.0)
    bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=8, logprobs=0), 0, 0)], 0.0)
    core.cancel(bid, 0.1)  # still queued: it ends at once
    (done,), _, finished = core.fetch(bid, 0)
    assert finished and done.finish_reason == "abort" and done.token_ids == []
    assert done.logprobs == []
