"""Drill: 10,000 forced give-up/finish races; 0 finals lost, 0 duplicated.

A give-up/finish race: the router takes a sequence back from replica a while a's engine finishes
it, so that the finish report is in flight, or arrives in the same tick, or after the give-up
landed. RouterCore is driven directly, a and b over drill_replica.py's scripted pull loop. Each
race: a and b join; a batch of one or two prompts is submitted (a runs sample 0, b sample 1); a
reports some of sample 0's tokens; then six events happen in one of the 30 orders that keep a's
two pulls in sequence (S1 R1 S2 R2: each pull's send, and its answer's arrival):
  F  a's engine finishes sample 0 (before an abort on its way lands: the natural end wins);
  G  the router takes it back, by kind:
     migrate  the policy gives it up for b (decided at b's pull, or at a's next one);
     lost     a goes silent past replica_timeout_s (its pull in flight times out) and expire
              declares it dead; it comes back with the same incarnation;
     leave    a is stopped (replica.py's hand-back: give up all, goodbye with the partials; the
              goodbye arrives, is lost, or arrives late);
     dead     a's engine dies (goodbye marked engine_dead: the tokens streamed, no final);
     restart  a's process restarts (new incarnation; its engine and unsent deltas gone; its late
              pulls still reach the router after the new process's first);
     cancel   the driver cancels the batch;
     cut      the driver cuts the batch (a partial rollout) and resumes what it cut in a new batch;
     router_restart  a new RouterCore (another id) takes over; the driver submits again what it
              had not received, naming the old ids (adoption.py); pulls in flight fail;
and each of a's two pulls meets one of PULL_FAULTS: none, its answer lost (the call fails: the
replica keeps its deltas and sends its finals whole), its report lost, its report applied twice
(the first or the second answer arrives), or its report applied late (after a's next one: a stale
listing, deltas already applied). Kinds x orders x faults = 8 x 30 x 36 = 8,640 combinations, each
raced once; the other 1,360 races draw the first combinations again, with other lengths. Seeded per
race: lengths and where the run stops, the tokens a reported first, one tick or 50 ms between
events, listings, when an engine's abort lands (at once, at the next report, after it). Then the
fleet runs without faults until every batch is done, and the drill checks that every (prompt,
sample) came back from fetch exactly once (a cut one: once across the cut batch and its
resumption; across a router restart: once from either router), with exactly the run's tokens: the
whole run, ended as the engine ends it, or (cancel) a prefix of it ending "abort"; and that the
router holds nothing once the batches are fetched. "contested" counts the races in which the
router took back a sequence it still ran while the engine ended that same attempt naturally.
"""
from __future__ import annotations

import itertools
import random
import time
from collections import Counter
from dataclasses import replace

from drill_replica import PULL_FAULTS, VOCAB, Replica, Truth
from rollout_cluster.policy.base import Decision, GiveUp
from rollout_cluster.policy.pull import PullPolicy
from rollout_cluster.protocol import SamplingSpec, SequenceRequest
from rollout_cluster.router.batches import Batches
from rollout_cluster.router.core import RouterCore
from rollout_cluster.router.reports import ReportApplier
from rollout_cluster.router.state import ClusterView, SeqStatus

RACES = 10_000
SEED = 24
KINDS = ("migrate", "lost", "leave", "dead", "restart", "cancel", "cut", "router_restart")
ORDERS = sorted({p for p in itertools.permutations(("F", "G", "S1", "R1", "S2", "R2"))
                 if [e for e in p if e[0] in "SR"] == ["S1", "R1", "S2", "R2"]})
COMBOS = [(k, o, f1, f2) for k in KINDS for o in ORDERS for f1 in PULL_FAULTS for f2 in PULL_FAULTS]
random.Random(SEED).shuffle(COMBOS)  # any first n races are a sample of them all
TIMEOUT_S = 2.0  # replica_timeout_s
SETTLE_ROUNDS = 40  # fault-free rounds (1 s apart) the batches must be done within
# The router's counters of the paths these races take (summed over every race)
PATHS = ("stale_reports", "duplicate_reports", "finals_whole_trimmed", "lost_orders", "migrations", "handed_back",
         "recovered", "replica_deaths", "orphans_given_up", "orphan_outputs_kept", "whole_finals_asked", "adopted",
         "partials_resumed")


class DrillPolicy(PullPolicy):
    """pull's dispatch, and the give-ups the drill arms (seq_id -> destination), at the next decision."""

    name = "drill"

    def __init__(self):
        self.armed: dict = {}
        self.issued = 0  # give-ups it made

    def decide(self, view: ClusterView, replica_id: str) -> Decision:
        d = super().decide(view, replica_id)
        for sid, dest in list(self.armed.items()):
            seq = view.seqs.get(sid)
            if seq is not None and seq.status is SeqStatus.RUNNING and seq.replica in view.replicas:
                d.give_up.append(GiveUp(seq, dest))
                del self.armed[sid]
                self.issued += 1
        return d


class Race:
    def __init__(self, kind: str, order: tuple, faults: tuple, rng: random.Random):
        self.kind, self.order, self.faults, self.rng = kind, order, dict(zip(("S1", "S2"), faults)), rng
        self.truths, self.violations = {}, []
        self.policy = DrillPolicy()
        self.core = RouterCore(self.policy, expected_replicas=2, replica_timeout_s=TIMEOUT_S)
        self.cores = [self.core]  # (a new one after a router restart)
        self.a, self.b = Replica("a", self.truths, self.violations), Replica("b", self.truths, self.violations)
        self.now = 0.0
        self.dt = 0.0 if rng.random() < 0.5 else 0.05  # every event in one tick, or 50 ms apart
        self.abort = rng.choice(("now", "next", "slow"))  # when an engine's abort lands
        self.live = self.finished = False  # sample 0 was live at the router at G; its engine ended it (F)
        self.bids: list = []  # the batches submitted, in order
        self.received: dict = {}  # batch_id -> completions fetched, in order
        self.cursor: dict = {}
        self.done: set = set()

    # ---- the race ---------------------------------------------------------------------------------
    def pull(self, rep: Replica, fault: str = "none", listing: bool = True) -> None:
        rep.send(self.core, self.now, fault, listing)
        rep.receive(self.abort)

    def run(self) -> dict:
        a, rng = self.a, self.rng
        self.pull(a)
        self.pull(self.b)
        self.requests = []
        for i in range(rng.choice((1, 2))):
            prompt = [rng.randrange(VOCAB) for _ in range(4)] + [i]
            max_tokens = rng.randint(2, 10)
            stop_at = rng.randint(1, max_tokens) if rng.random() < 0.5 else max_tokens + rng.randint(0, 2)
            self.truths[tuple(prompt)] = Truth(rng.randrange(VOCAB), stop_at)
            self.requests.append(SequenceRequest(prompt, SamplingSpec(max_tokens=max_tokens), i, 0))
        self.bid = bid = self._submit(self.requests)
        self.resubmitted = True
        self.pull(a)
        self.pull(self.b)
        key = (f"{bid}:0", 1)
        run = a.engine.runs[key]
        a.engine.advance(key, rng.randint(0, len(run.out) - 1))
        if len(self.requests) > 1:
            self.b.engine.advance((f"{bid}:1", 1), rng.randint(0, 3))
        if run.produced or rng.random() < 0.5:
            self.pull(a)
        for event in self.order:
            self.now += self.dt
            if event == "F":
                self.finished = a.engine.finish(key)
            elif event == "G":
                self.give_up()
            elif a.up and event[0] == "S":
                a.engine.advance(key, rng.randint(0, 1))
                a.send(self.core, self.now, self.faults[event], listing=rng.random() < 0.5)
            elif a.up:
                a.receive(self.abort)
        self.policy.armed.clear()
        bids = self.bids
        if self.kind == "router_restart" and len(bids) == 1 and not self.resubmitted:
            self.resubmit()
        settled = self.settle(bids)
        if self.kind == "cut" and settled:
            cut = [c for c in self.received[bid] if c.finish_reason == "abort"]
            if cut:
                resumed = [SequenceRequest(self.requests[c.prompt_index].prompt_token_ids,
                                           self.requests[c.prompt_index].sampling, c.prompt_index, 0,
                                           output_token_ids=list(c.token_ids) or None) for c in cut]
                self._submit(resumed)
                settled = self.settle(bids)
        return self.check(bids)

    def _submit(self, requests: list, previous_ids=None) -> str:
        bid = self.core.submit(requests, self.now, previous_ids=previous_ids)
        self.received[bid], self.cursor[bid] = [], 0
        self.bids.append(bid)
        return bid

    def restart_router(self) -> None:
        """A new router (another id) takes over: the old one's batches, and the pulls it had not
        answered, are gone; a pull to it fails (finals then go whole) or went through unnoticed."""
        self.fetch([self.bid])  # what the driver had before; the rest of the batch is lost
        self.done.add(self.bid)
        self.core = RouterCore(self.policy, expected_replicas=2, replica_timeout_s=TIMEOUT_S, id_prefix="r2-")
        self.cores.append(self.core)
        for rep in (self.a, self.b):
            rep.late = []
            if rep.answer is not None or self.rng.random() < 0.5:
                rep.answer, rep.pull_failed = None, True
        self.resubmitted = False
        if self.rng.random() < 0.5:
            self.resubmit()

    def resubmit(self) -> None:
        """The driver submits again what it had not received, naming each sequence's old id."""
        self.resubmitted = True
        self.pull(self.b, listing=False)  # (a replica joins the new router first)
        have = {c.index for c in self.received[self.bid]}
        todo = [i for i in range(len(self.requests)) if i not in have]
        if todo:
            self._submit([self.requests[i] for i in todo], previous_ids=[f"{self.bid}:{i}" for i in todo])

    def give_up(self) -> None:
        core, a, b, kind = self.core, self.a, self.b, self.kind
        sid = f"{self.bid}:0"
        self.live = sid in core.seqs  # the router still ran it when it took it back
        if kind == "migrate":
            self.policy.armed[sid] = "b"
            if self.rng.random() < 0.5:  # at b's pull; else at a's next
                self.pull(b, listing=False)
        elif kind == "lost":
            a.answer = None  # its pull in flight times out
            self.now += TIMEOUT_S + 0.5
            self.pull(b, listing=False)
            assert core.expire(self.now) == ["a"]
        elif kind in ("leave", "dead"):
            if a.answer is not None and kind == "leave" and self.rng.random() < 0.5:
                a.receive(self.abort)  # the hand-back waits for the pull in flight
            elif a.answer is not None and kind == "dead":
                a.unsent, a.answer = [], None  # delivered; its orders meet a dead engine
            elif a.answer is not None:
                a.answer, a.pull_failed = None, True  # abandoned: finals go whole
            goodbye = a.goodbye(engine_dead=kind == "dead")
            a.send(core, self.now, self.rng.choice(("none", "lost_report", "late")), report=goodbye)
        elif kind == "restart":
            a.restart()
        elif kind == "router_restart":
            self.restart_router()
        else:  # cancel, cut
            core.cancel(self.bid, self.now)

    # ---- after the race: no faults until the batches are done -----------------------------------------
    def settle(self, bids: list) -> bool:
        for _ in range(SETTLE_ROUNDS):
            self.fetch(bids)
            if all(bid in self.done for bid in bids):
                return True
            for rep in (self.a, self.b):
                if rep.up:
                    rep.engine.finish_all()
                    self.pull(rep)
                else:
                    rep.flush_late(self.core, self.now)
            self.core.expire(self.now)
            self.now += 1.0
        return False

    def fetch(self, bids: list) -> None:
        for bid in bids:
            if bid in self.done:
                continue
            got, self.cursor[bid], done = self.core.fetch(bid, self.cursor[bid], self.now)
            self.received[bid] += got
            if done:
                again, _, _ = self.core.fetch(bid, 0, self.now)  # a retried fetch: the same, in order
                assert [(c.index, list(c.token_ids)) for c in again] == [
                    (c.index, list(c.token_ids)) for c in self.received[bid]]
                self.core.release(bid)
                self.done.add(bid)

    # ---- the checks ---------------------------------------------------------------------------------
    def check(self, bids: list) -> dict:
        """Counts of finals lost, duplicated and wrong for this race, and how it went. A final ends
        its (prompt, sample): every completion but a cut batch's aborts (resumed in the next)."""
        finals: dict = {}  # prompt_index -> the finals that ended it
        dup, wrong = 0, list(self.violations)
        for n, bid in enumerate(bids):
            seen = Counter(c.index for c in self.received[bid])
            dup += sum(v - 1 for v in seen.values() if v > 1)
            for c in self.received[bid]:
                req = self.requests[c.prompt_index]
                truth = self.truths[tuple(req.prompt_token_ids)]
                length = min(truth.stop_at, req.sampling.max_tokens)
                if c.finish_reason == "abort" and n == 0 and self.kind in ("cancel", "cut"):
                    want, why = truth.tokens(0, min(len(c.token_ids), length)), "abort"
                else:
                    want, why = truth.tokens(0, length), "stop" if truth.stop_at <= req.sampling.max_tokens else "length"
                if not (c.finish_reason == "abort" and self.kind == "cut" and n == 0):
                    finals.setdefault(c.prompt_index, []).append(c)
                if list(c.token_ids) != want or c.finish_reason != why:
                    wrong.append(f"{c.batch_id}:{c.index}: {c.finish_reason} {list(c.token_ids)}, want {why} {want}")
        lost = sum(p not in finals for p in range(len(self.requests)))
        dup += sum(len(f) - 1 for f in finals.values())
        if not wrong and not lost and (self.core.seqs or len(self.core.queue)):
            wrong.append("the router still holds sequences of released batches")
        first = finals.get(0, [None])[0]
        outcome = ("finish_won" if first is not None and first.replicas == ["a"] and first.finish_reason != "abort"
                   and not first.migrations and first.batch_id == bids[0] else "give_up_won")
        paths = Counter({k: sum(getattr(c.counters, k) for c in self.cores) for k in PATHS})
        live = self.policy.issued > 0 if self.kind == "migrate" else self.live
        return {"lost": lost, "duplicated": dup, "wrong": wrong, "outcome": outcome, "paths": paths,
                "contested": live and self.finished}


def race(i: int) -> dict:
    kind, order, f1, f2 = COMBOS[i % len(COMBOS)]
    return Race(kind, order, (f1, f2), random.Random(SEED * 1_000_003 + i)).run()


def run_drill(n: int = RACES) -> dict:
    """Race `n` times; the counts (by kind, outcome and pull fault; lost, duplicated, wrong) and
    the first failures."""
    by_kind, outcomes, faults, paths, contested = Counter(), Counter(), Counter(), Counter(), Counter()
    lost = duplicated = wrong = 0
    failures = []
    for i in range(n):
        kind, _, f1, f2 = COMBOS[i % len(COMBOS)]
        r = race(i)
        by_kind[kind] += 1
        contested[kind] += r["contested"]
        outcomes[f"{kind}/{r['outcome']}"] += 1
        faults.update((f1, f2))
        paths.update(r["paths"])
        lost, duplicated, wrong = lost + r["lost"], duplicated + r["duplicated"], wrong + bool(r["wrong"])
        if (r["lost"] or r["duplicated"] or r["wrong"]) and len(failures) < 5:
            failures.append((i, COMBOS[i % len(COMBOS)], r))
    return {"races": n, "by_kind": dict(by_kind), "contested": dict(contested), "outcomes": dict(sorted(outcomes.items())),
            "pull_faults": dict(faults), "router_paths": dict(paths), "lost": lost, "duplicated": duplicated,
            "races_with_wrong_tokens": wrong, "failures": failures}


def test_ten_thousand_forced_races_lose_and_duplicate_no_final():
    t0 = time.perf_counter()
    counts = run_drill()
    counts["seconds"] = round(time.perf_counter() - t0, 1)
    print(counts)
    assert len(ORDERS) == 30 and len(COMBOS) == 8640 <= RACES  # every order under every pair of faults
    assert counts["failures"] == [] and counts["lost"] == 0 and counts["duplicated"] == 0
    assert counts["races_with_wrong_tokens"] == 0
    assert sum(counts["by_kind"].values()) == RACES
    for kind in KINDS:  # both outcomes happen in every kind: these are races
        assert counts["outcomes"].get(f"{kind}/finish_won") and counts["outcomes"].get(f"{kind}/give_up_won"), kind
    assert all(counts["router_paths"][k] for k in PATHS), counts["router_paths"]  # every path taken


# ---- the drill can fail: a router that breaks an invariant is caught ----------------------------------
def test_the_drill_catches_a_resent_delta_counted_twice(monkeypatch):
    apply = ReportApplier.seq_progress

    def without_offsets(self, rep, p, now, *args):  # no duplicate check: p.offset "not tracked"
        apply(self, rep, replace(p, offset=-1) if p.prompt_token_ids is None else p, now, *args)

    monkeypatch.setattr(ReportApplier, "seq_progress", without_offsets)
    assert run_drill(400)["races_with_wrong_tokens"] > 0


def test_the_drill_catches_lost_work_never_sent_again(monkeypatch):
    monkeypatch.setattr(ReportApplier, "reconcile", lambda self, rep, held, aborting, now, fresh=True: None)
    assert run_drill(400)["lost"] > 0


def test_the_drill_catches_a_final_recorded_twice(monkeypatch):
    record = Batches.record

    def twice(self, batch_id, index, done):
        record(self, batch_id, index, done)
        if done.migrations:  # a sequence that moved: its final comes back twice
            record(self, batch_id, index, done)

    monkeypatch.setattr(Batches, "record", twice)
    assert run_drill(400)["duplicated"] > 0
