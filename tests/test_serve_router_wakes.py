"""The Serve-facing shell around RouterCore (serve/router.py, deploy.py, metrics.py, the
credentials the Router keeps): whatever queues work wakes the held pulls and whatever finishes
sequences wakes the drivers' fetches (the reaper, a listing, a stall, a new fleet target); a dead
replica's credential and, after a while, its metric series go; a nonce's journal write does not
block the router's loop; a deploy that fails inside Serve's _run leaves no app. Driven in-process,
without Ray or Serve. (A review found each; the docstrings say what was wrong.)"""
import asyncio
import time as real_time
import types

import pytest

from rollout_cluster.config import ClusterConfig, load_config, to_dict
from rollout_cluster.protocol import (EngineStats, Listing, ModelInfo, Report, SamplingSpec, SeqProgress,
                                      SequenceRequest)
from rollout_cluster.router import adoption as router_adoption
from rollout_cluster.serve import router as router_module
from rollout_cluster.serve.metrics import GONE_SERIES_KEEP_S
from rollout_cluster.serve.router import Router
from router_support import SIGNER, Clock, FastAsyncio, order, pull


def report(rid: str, progress=(), leaving: bool = False) -> Report:
    return Report(rid, "i1", progress=list(progress), stats=EngineStats(), model=ModelInfo(100, 64), capacity=8,
                  leaving=leaving)


def request(max_tokens: int = 8, index: int = 0) -> SequenceRequest:
    return SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=max_tokens), index, 0)


def router_of(**cfg) -> Router:
    return Router.func_or_class(to_dict(ClusterConfig(**{"replicas": 1, "engine": {"kind": "sim"}, **cfg})))


async def timed(coro):
    t0 = real_time.monotonic()
    out = await coro
    return out, real_time.monotonic() - t0


# ---- held pulls and fetches that nothing wakes ------------------------------------------------------

def test_work_the_reaper_queues_after_an_adoption_wait_wakes_the_held_pulls(monkeypatch):
    """serve/router.py _reap_once (lines 106-113): a restarted router's resubmitted sequence waits
    (out of the queue) up to ADOPT_WAIT_S for its predecessor's output; when none comes,
    `core.expire` -> OrphanAdoption.expire puts it in the queue from the reaper's tick. The reaper
    wakes held pulls only when a replica died (`if dead: self._wake_all()`), so an idle replica
    whose pull is held does not see that work until its hold runs out (idle_pull_wait_for: 1 s, up
    to 5 s in a large fleet). New work must wake held pulls at once, as a submit or a requeue in a
    pull does (docs/architecture.md: "Holding longer costs no latency, because new work wakes a
    held pull at once")."""
    clock = Clock()
    monkeypatch.setattr(router_module, "time", clock)
    monkeypatch.setattr(router_module, "asyncio", FastAsyncio())

    async def go():
        router = router_of(router={"idle_pull_wait_s": 3.0})
        try:
            await pull(router, report("a"))  # joins; it has not listed what it runs yet
            await router.submit([request()], previous_ids=["zz9999-b0-0123456789abcdef:0"])
            assert "zz9999-b0-0123456789abcdef:0" in router.core.adoption.awaiting_orphans
            held = asyncio.ensure_future(timed(pull(router, report("a"))))
            await asyncio.sleep(0.2)
            assert not held.done()  # an idle pull, held
            clock.offset = router_adoption.ADOPT_WAIT_S + 1  # the reaper's next tick queues the sequence
            orders, seconds = await held
            return orders, seconds
        finally:
            router._reaper.cancel()

    orders, seconds = asyncio.run(go())
    assert len(orders.start) == 1
    assert seconds < 1.0, f"the held pull saw the queued work only when its hold ran out ({seconds:.2f} s)"


def test_work_a_listing_releases_from_the_adoption_wait_wakes_the_other_held_pulls():
    """serve/router.py pull (line 160) with router/moves.py requeue (lines 232-233): after a router
    restart the driver resubmits its batch; each sequence waits, out of the queue, until every
    replica has listed what it runs (OrphanAdoption._may_still_run). The last listing puts them
    all in the queue, inside that replica's report, through SeqMoves.requeue, which does not count
    in `moves.requeues`, so `applied.requeued` is False and the Serve router wakes nobody: the
    lister takes its share, and the other replicas, idle and held, wait out their hold (1-5 s)
    before they take the rest of the batch."""

    async def go():
        router = router_of(replicas=2, policy={"name": "pull"}, router={"idle_pull_wait_s": 3.0})
        try:
            for rid in ("a", "b"):
                await pull(router, report(rid))  # joined; neither has listed what it runs yet
            old = [f"zz9999-b0-0123456789abcdef:{i}" for i in range(4)]
            router.core.submit([request(index=i) for i in range(4)], router_module.time.monotonic(),
                               previous_ids=old)
            assert len(router.core.adoption.awaiting_orphans) == 4 and not len(router.core.queue)
            listed = report("a")
            listed.listing = Listing([], [])
            assert not (await pull(router, listed)).start  # b has not listed yet: they still wait
            held = asyncio.ensure_future(timed(pull(router, report("a"))))
            await asyncio.sleep(0.2)
            assert not held.done()
            listed = report("b")
            listed.listing = Listing([], [])
            b_took = (await pull(router, listed)).start  # every replica listed: all four queued
            a_orders, seconds = await held
            return len(b_took), len(a_orders.start), seconds
        finally:
            router._reaper.cancel()

    b_took, a_took, seconds = asyncio.run(go())
    assert b_took == 2 and a_took == 2
    assert seconds < 1.0, f"a's held pull saw the released work only when its hold ran out ({seconds:.2f} s)"


def test_a_cancelled_batch_finished_by_the_reaper_wakes_its_drivers_fetch(monkeypatch):
    """serve/router.py _reap_once (lines 108-113, 120-124): a cancelled batch's running sequence
    finishes (as "abort") when its replica is declared dead (or stalled) and the sequence is
    requeued (moves.requeue_after_segment: "a cancelled one finishes"). The reaper wakes held pulls
    but never `_notify_batches()`, so the driver's fetch long-poll sleeps out its whole wait_s with
    the batch already done. (The same in settle's fail_queued_if_no_replica_can_load, which fails
    queued sequences from the reaper.) A finish must wake the fetches, as applied.finished does in
    pull."""
    clock = Clock()
    monkeypatch.setattr(router_module, "time", clock)
    monkeypatch.setattr(router_module, "asyncio", FastAsyncio())

    async def go():
        router = router_of(router={"replica_timeout_s": 20.0})
        try:
            await pull(router, report("a"))
            bid = await router.submit([request()])
            (work,) = (await pull(router, report("a"))).start
            await router.cancel(order("cancel", batch_id=bid))  # its give-up waits for a's next pull
            fetching = asyncio.ensure_future(timed(router.fetch(bid, 0, 3.0)))
            await asyncio.sleep(0.2)
            assert not fetching.done()
            clock.offset = 25.0  # a never pulls again: the reaper declares it dead
            (new, _, done), seconds = await fetching
            return new, done, seconds, router.core.fleet.replicas
        finally:
            router._reaper.cancel()

    new, done, seconds, live = asyncio.run(go())
    assert not live and done and [c.finish_reason for c in new] == ["abort"]
    assert seconds < 1.5, f"the fetch slept out its wait_s with the batch done ({seconds:.2f} s)"


def test_a_report_that_stalls_its_replica_and_finishes_sequences_wakes_the_fetches(monkeypatch):
    """serve/router.py pull (lines 150-157): when a report makes the router declare its replica
    stalled, the pull returns Orders.stop before `if applied.finished: self._notify_batches()`.
    Removing a stalled replica finishes its cancelled batch's sequences (the engine hung, so the
    cancel's give-up could never be confirmed: this is exactly when a stall frees them), and
    applied.finished says so, but no fetch is woken: the driver waits its full wait_s for a batch
    that is done."""
    clock = Clock()
    monkeypatch.setattr(router_module, "time", clock)

    async def go():
        router = router_of(router={"stall_timeout_s": 30.0})
        router._reaper.cancel()  # (the pull alone declares the stall here)
        await pull(router, report("a"))
        bid = await router.submit([request()])
        (work,) = (await pull(router, report("a"))).start
        await pull(router, report("a", [SeqProgress(work.seq_id, work.attempt, [7], offset=0)]))
        await router.cancel(order("cancel", batch_id=bid))
        fetching = asyncio.ensure_future(timed(router.fetch(bid, 0, 3.0)))
        await asyncio.sleep(0.2)
        clock.offset = 31.0  # no token since: a's next report is the stall
        orders = await pull(router, report("a"))
        (new, _, done), seconds = await fetching
        return orders, new, done, seconds

    orders, new, done, seconds = asyncio.run(go())
    assert orders.stop and done and [c.finish_reason for c in new] == ["abort"]
    assert seconds < 1.5, f"the fetch slept out its wait_s with the batch done ({seconds:.2f} s)"


def test_a_new_fleet_target_wakes_the_held_pulls_it_lets_start(monkeypatch):
    """serve/router.py set_fleet_target (lines 347-350): RolloutClient.scale's new count changes
    what the policy decides (chunked's first round waits for `expected` replicas; static deals its
    shares again for a resized fleet), but unlike every other control order (update_weights,
    sleep, wake, cancel, push_*) it wakes no held pull. A batch that chunked held back for a second
    replica starts only when the idle pull's hold runs out (1-5 s), not when the target says one
    replica is the fleet."""

    async def go():
        router = router_of(replicas=2, policy={"name": "chunked"}, router={"idle_pull_wait_s": 3.0})
        try:
            await pull(router, report("a"))
            router.core.submit([request(), request(index=1)], router_module.time.monotonic())
            router._wake_all()
            assert not (await pull(router, report("a"))).start  # chunked waits for the 2nd replica
            held = asyncio.ensure_future(timed(pull(router, report("a"))))
            await asyncio.sleep(0.2)
            assert not held.done()
            assert await router.set_fleet_target(order("set_fleet_target", replicas=1)) == 1
            return await held
        finally:
            router._reaper.cancel()

    orders, seconds = asyncio.run(go())
    assert len(orders.start) == 2
    assert seconds < 1.0, f"the held pull took its work only when its hold ran out ({seconds:.2f} s)"


# ---- state kept for replicas that are gone ----------------------------------------------------------

def test_a_dead_replicas_report_credential_is_forgotten(monkeypatch):
    """serve/router.py _reap_once (lines 108-113): a replica declared dead (silent for
    replica_timeout_s: a crash, a killed actor, a lost node; Serve replaces it under a NEW replica
    id) has its work_ready event dropped, but its credential stays in ReplicaCredentials.issued for
    the router's whole life. `forget` is called only for a stall or a goodbye, so the dict grows by
    one entry per replica that ever died, and the dead replica's credential stays valid. It should
    be forgotten like the other per-replica state (a late pull then registers again, as
    router_link.py already handles)."""
    clock = Clock()
    monkeypatch.setattr(router_module, "time", clock)
    monkeypatch.setattr(router_module, "asyncio", FastAsyncio())

    async def go():
        router = router_of(replicas=3, router={"replica_timeout_s": 20.0})
        try:
            for rid in ("a", "b", "c"):
                await pull(router, report(rid))
            clock.offset = 25.0
            await pull(router, report("a"))  # a lives on; b and c died
            await asyncio.sleep(0.2)  # the reaper's ticks
            return sorted(router.core.fleet.replicas), sorted(router.credentials)
        finally:
            router._reaper.cancel()

    live, credentials = asyncio.run(go())
    assert live == ["a"]
    assert credentials == ["a"], f"credentials kept for dead replicas: {credentials}"


def test_prometheus_series_of_replicas_that_left_are_dropped_after_a_while():
    """serve/metrics.py (lines 17-19, 28-32, 63-67): rollout_sequences_finished_total{replica},
    rollout_migrations_total{source} and rollout_sequences_resumed_total{source} are labelled by
    Serve's replica id, which is new for every replacement and every scale-up. `gauges` prunes the
    per-replica `running` gauge of replicas that are gone ("gone: sum() must not count it"), but
    the counters keep one series per (replica ever seen x reason) for the router's life: the
    registry and every scrape grow with fleet churn without bound. Series of replicas that left
    should go (or the label should not be the replica id)."""

    async def go():
        router = router_of(replicas=1, router={"idle_pull_wait_s": 0.05})
        try:
            for i in range(20):  # 20 short-lived replicas, one after another: a replacement each
                rid = f"replica-{i}"
                await pull(router, report(rid))
                bid = await router.submit([request(max_tokens=2)], wait_for_replica_s=0)
                (work,) = (await pull(router, report(rid))).start
                await pull(router, report(rid, [SeqProgress(work.seq_id, work.attempt, [5, 6], finish_reason="length",
                                                            offset=0)]))
                await router.fetch(bid, 0, 0.0)
                await pull(router, report(rid, leaving=True))
            now = router_module.time.monotonic()
            router._reap_once(now)  # gauges
            kept = gone_series(router.metrics.registry)
            router.metrics.gauges(router.core, now + GONE_SERIES_KEEP_S)
            return kept, gone_series(router.metrics.registry)
        finally:
            router._reaper.cancel()

    def gone_series(registry) -> set:
        return {(m.name, s.labels.get("replica") or s.labels.get("source"))
                for m in registry.collect() for s in m.samples
                if (s.labels.get("replica") or s.labels.get("source") or "-").startswith("replica-")}

    kept, after = asyncio.run(go())
    # a scrape (and an alert's increase() window) still sees a replica's last counts after it left ...
    assert {rid for _, rid in kept} == {f"replica-{i}" for i in range(20)}
    # ... and then its series go
    assert not after, f"{len(after)} label series kept for replicas that left, e.g. {sorted(after)[:3]}"


def test_a_gone_replicas_series_stay_for_the_grace_and_a_live_ones_for_good():
    """The grace, without a router: a replica's counts stay GONE_SERIES_KEEP_S after it is first
    found gone, then go; a live replica's never; one that comes back is live again."""
    from rollout_cluster.serve.metrics import PrometheusRouterMetrics

    m = PrometheusRouterMetrics()
    fleet = {"a": types.SimpleNamespace(seqs={}), "b": types.SimpleNamespace(seqs={})}
    core = types.SimpleNamespace(queue=[], weights=types.SimpleNamespace(version=0, errors={}),
                                 sleep=types.SimpleNamespace(level=0),
                                 fleet=types.SimpleNamespace(replicas=fleet, expected=2))
    for rid in ("a", "b"):
        m.finished(rid, "length")
        m.resumed(rid, "replica_lost")
    m.migration("a", 10)

    def replicas_counted() -> set:
        return {s.labels.get("replica") or s.labels.get("source") for mf in m.registry.collect()
                for s in mf.samples if s.name.endswith("_total") and (s.labels.get("replica") or s.labels.get("source"))}

    del fleet["a"]
    m.gauges(core, 100.0)  # a found gone
    m.gauges(core, 100.0 + GONE_SERIES_KEEP_S - 1)
    assert replicas_counted() == {"a", "b"}
    m.gauges(core, 100.0 + GONE_SERIES_KEEP_S)
    assert replicas_counted() == {"b"}
    m.gauges(core, 100.0 + 10 * GONE_SERIES_KEEP_S)
    assert replicas_counted() == {"b"}  # live: kept for good


# ---- the event loop blocked ------------------------------------------------------------------------

def test_journaling_a_control_orders_nonce_does_not_block_the_router_loop(monkeypatch):
    """serve/router.py _order (lines 85-92, journal attached at line 80): every accepted control
    order, each replica's `register` included (all of them again after a router restart), writes
    its nonce to Ray's GCS key-value store (security/nonce_journal.GcsKV: internal_kv put, and
    deletes of expired keys) synchronously, on the router's event loop. While the GCS is slow or
    restarting (GCS fault tolerance: Serve keeps serving), the whole router stops: no held pull is
    answered, no fetch returns, the reaper does not run. The write must not run on the loop (a
    thread, awaited before the order runs)."""

    class SlowKV:
        """Ray's GCS as a slow store: each write takes 0.5 s."""

        def __init__(self, namespace):
            self.keys_ = []

        def put(self, key):
            real_time.sleep(0.5)
            self.keys_.append(key)

        def keys(self):
            return list(self.keys_)

        def delete(self, key):
            self.keys_.remove(key)

    monkeypatch.setattr(router_module, "GcsKV", SlowKV)
    monkeypatch.setattr(router_module, "_app_name", lambda: "rollout")

    async def go():
        router = router_of()
        try:
            lags = []

            async def ticker():
                while True:
                    t = real_time.monotonic()
                    await asyncio.sleep(0.01)
                    lags.append(real_time.monotonic() - t - 0.01)

            tick = asyncio.ensure_future(ticker())
            await asyncio.sleep(0.05)
            await router.register(SIGNER.sign("register", {"replica_id": "a", "incarnation": "i1"}))
            await asyncio.sleep(0.05)
            tick.cancel()
            return max(lags), router.verifier.accepted
        finally:
            router._reaper.cancel()

    worst_lag, accepted = asyncio.run(go())
    assert accepted == 1
    assert worst_lag < 0.2, f"the router's event loop stood still {worst_lag:.2f} s for one register order"


# ---- deploy ----------------------------------------------------------------------------------------

def test_deploy_removes_the_app_when_serves_run_itself_fails_or_is_interrupted(monkeypatch):
    """serve/deploy.py deploy (line 27): `_run(app, _blocking=False)` is outside the try that
    deletes the app. Serve's _run first hands the application to the controller (it is deployed
    from then on: engines start loading) and then waits, without a bound of ours, for the ingress
    deployment's creation and for every node's proxy (client.wait_for_proxies_serving, which raises
    TimeoutError after HTTP_PROXY_TIMEOUT = 60 s). A Ctrl-C / `ray job stop` in those waits, or
    that TimeoutError, leaves the half-deployed app holding its GPUs: the docstring promises it is
    removed "as it is when the wait is interrupted"."""
    import ray.serve.api as api
    from ray import serve

    from rollout_cluster.serve.deploy import deploy

    apps = set()

    def run(app, _blocking=False, name="default", **kw):
        apps.add(name)  # controller.deploy_applications went through
        raise TimeoutError("Proxies not available after 60s.")  # wait_for_proxies_serving

    monkeypatch.setattr(api, "_run", run)
    monkeypatch.setattr(serve, "status", lambda: types.SimpleNamespace(applications={}))
    monkeypatch.setattr(serve, "delete", apps.discard)
    cfg = load_config({"engine": {"kind": "sim"}})
    with pytest.raises(TimeoutError):
        deploy(object(), cfg, timeout_s=600)
    assert apps == set(), "the app Serve's _run deployed before it failed was left on the cluster"
