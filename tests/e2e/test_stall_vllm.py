"""Liveness (issue 24) on the real cluster: one replica's vLLM EngineCore process is stopped with
SIGSTOP mid-batch. Its replica keeps pulling (the pull loop runs in the replica's own process), so
no replica timeout (8 s here) ever fires; the router declares it stalled after
router.stall_timeout_s (20 s here) without a new token, its sequences continue on the other
replica from their last reported tokens, and its health check fails, so Serve replaces it. Every
(prompt, sample) completes once, at its length; the fleet is back to 2 replicas afterwards."""
import signal
import time

import pytest
import ray

from e2e_support import collect
from rollout_cluster.client.expand import expand
from rollout_cluster.protocol import SamplingSpec
from test_replica_failure import engine_core_processes, engine_replica_actors

pytestmark = pytest.mark.e2e


def test_a_stopped_engine_is_declared_stalled_and_every_sequence_completes_once(client, cluster_config, fresh_policy):
    fresh_policy("pull")
    stall_s = cluster_config.router.stall_timeout_s
    before = client.status()
    lengths = [400] * 8 + [300] * 8
    prompts = [[90 + i, 51, 52] for i in range(len(lengths))]
    bid = client.submit(expand(prompts, [SamplingSpec(max_tokens=n, ignore_eos=True, logprobs=0) for n in lengths]))
    t0 = time.monotonic()
    while True:  # both replicas run, and have made tokens: the stopped one's partials are kept
        st = client.status()
        if st["counters"]["generated_tokens"] - before["counters"]["generated_tokens"] >= 8 * len(lengths):
            break
        assert time.monotonic() - t0 < 30, "the batch made no tokens"
        time.sleep(0.1)
    victim_id = max(st["replicas"], key=lambda r: st["replicas"][r]["running"])
    assert st["replicas"][victim_id]["running"] > 0
    (actor,) = [a for a in engine_replica_actors() if victim_id in a["name"]]
    victim = ray.get_actor(actor["name"], namespace=actor["namespace"])
    cores = engine_core_processes(victim)
    assert cores, "found no EngineCore process under the replica's actor"
    try:
        for p in cores:
            p.send_signal(signal.SIGSTOP)
        stopped_t = time.monotonic()
        while client.status()["counters"]["replica_stalls"] == before["counters"]["replica_stalls"]:
            assert time.monotonic() - stopped_t < stall_s + 15, "the stopped engine's replica was not declared stalled"
            time.sleep(0.2)
        took = time.monotonic() - stopped_t
        st = client.status()
        # by the stall timeout, from its last token (just before the stop), not sooner
        assert took > stall_s - 1.0, took
        assert victim_id not in st["replicas"]
        # it pulled on all along: no replica timeout declared it dead
        assert st["counters"]["replica_deaths"] == before["counters"]["replica_deaths"]
        assert st["counters"]["replica_stalls"] == before["counters"]["replica_stalls"] + 1
        # its pull loop heard it and ended: its health check fails (Serve replaces it)
        t1 = time.monotonic()
        while True:
            try:
                ray.get(victim.check_health.remote(), timeout=30)
            except ray.exceptions.RayTaskError as e:
                assert "declared this replica stalled" in str(e)
                break
            assert time.monotonic() - t1 < 10, "the stalled replica still passes its health check"
            time.sleep(0.2)
    finally:
        for p in cores:  # resumed, it must not hand anything back (nor report it)
            try:
                p.send_signal(signal.SIGCONT)
            except Exception:
                pass
    results = collect(client, bid, len(lengths))  # (fails on a sequence returned twice)
    assert [c.finish_reason for c in results] == ["length"] * len(lengths), [c.error for c in results if c.error]
    assert [len(c.token_ids) for c in results] == lengths
    assert all(len(c.logprobs) == len(c.token_ids) for c in results)
    resumed = [c for c in results if victim_id in c.replicas and len(c.replicas) > 1]
    assert resumed, "the stalled replica's sequences should have continued on the other replica"
    assert all(any(m.source == victim_id and m.reason == "replica_lost" for m in c.migrations) for c in resumed)
    assert any(m.at_token > 0 for c in resumed for m in c.migrations), "no partial tokens were kept"
    assert not [c for c in results if c.replicas == [victim_id]], "a sequence finished on the stalled replica"
    # Serve replaces it: the fleet is back to 2 replicas, the stalled one not among them
    t2 = time.monotonic()
    while True:
        st = client.status()
        if len(st["replicas"]) == 2 and victim_id not in st["replicas"]:
            break
        assert time.monotonic() - t2 < 240, f"the stalled replica was not replaced: {sorted(st['replicas'])}"
        time.sleep(0.5)
    assert st["counters"]["replica_stalls"] == before["counters"]["replica_stalls"] + 1
    print(f"stall declared {took:.1f} s after SIGSTOP; replaced {time.monotonic() - t2:.1f} s after the batch")
