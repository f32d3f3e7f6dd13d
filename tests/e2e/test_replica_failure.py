"""A replica leaves mid-batch, shut down by Serve (it hands its work back with every token) or
killed (its work continues from its last reported tokens): every sequence completes elsewhere,
once. The cluster then waits for Serve's replacement replica (the fresh_policy fixture)."""
import time

import pytest
import ray

from e2e_support import collect
from rollout_cluster.client.expand import expand
from rollout_cluster.protocol import SamplingSpec

pytestmark = pytest.mark.e2e


def engine_replica_actors():
    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if "EngineReplica" in a["name"]]


def batch_and_busiest_replica(client, first_token: int) -> tuple:
    """(batch id, lengths, busiest replica's id, its actor): a batch of long sequences submitted
    and running on both replicas for a second."""
    # Long enough that none ends before Serve's graceful shutdown (a drain check first: 0.2 s,
    # serve/app.py) hands the leaving replica's work back: a sequence that finished there would
    # never have moved.
    lengths = [1500] * 8 + [1000] * 8
    prompts = [[first_token + i, 51, 52] for i in range(len(lengths))]
    requests = expand(prompts, [SamplingSpec(max_tokens=n, ignore_eos=True, logprobs=0) for n in lengths])
    bid = client.submit(requests)
    time.sleep(1.0)
    st = client.status()
    rid = max(st["replicas"], key=lambda r: st["replicas"][r]["running"])
    assert st["replicas"][rid]["running"] > 0
    (actor,) = [a for a in engine_replica_actors() if rid in a["name"]]
    return bid, lengths, rid, ray.get_actor(actor["name"], namespace=actor["namespace"])


def test_replica_shut_down_by_serve_hands_its_work_back_at_once(client, fresh_policy):
    """What Serve's controller does to a replica when it scales the deployment down or replaces
    it: a graceful shutdown, which calls the replica's __del__."""
    fresh_policy("pull")
    bid, lengths, leaving_id, actor = batch_and_busiest_replica(client, 50)
    ray.get(actor.perform_graceful_shutdown.remote(), timeout=120)
    # Back already (router.replica_timeout_s is 8 s here): it said goodbye, it did not go silent.
    st = client.status()
    assert leaving_id not in st["replicas"]
    assert st["counters"]["replica_leaves"] == 1 and st["counters"]["replica_deaths"] == 0
    results = collect(client, bid, len(lengths))
    assert [len(c.token_ids) for c in results] == lengths
    assert all(c.finish_reason == "length" and len(c.logprobs) == len(c.token_ids) for c in results)
    resumed = [c for c in results if c.replicas[0] == leaving_id]
    assert resumed and all(len(c.replicas) == 2 for c in resumed)
    assert all(not c.migrations for c in results if c not in resumed)  # the other replica's stayed
    # each says why it moved: handed back, at the token it had reached
    assert all([(m.source, m.reason) for m in c.migrations] == [(leaving_id, "replica_left")] for c in resumed)
    assert all(0 <= c.migrations[0].at_token < len(c.token_ids) for c in resumed)


def test_killed_replica_work_completes_elsewhere(client, fresh_policy):
    fresh_policy("pull")
    bid, lengths, victim_id, victim = batch_and_busiest_replica(client, 30)
    ray.kill(victim, no_restart=True)
    results = collect(client, bid, len(lengths))
    assert [len(c.token_ids) for c in results] == lengths
    assert all(len(c.logprobs) == len(c.token_ids) for c in results)
    resumed = [c for c in results if victim_id in c.replicas and len(c.replicas) > 1]
    assert resumed, "the killed replica's sequences should have continued on the survivor"
    assert all(any(m.source == victim_id and m.reason == "replica_lost" for m in c.migrations) for c in resumed)
    assert client.status()["counters"]["replica_deaths"] >= 1


def engine_core_processes(actor) -> list:
    """The vLLM EngineCore process(es) the replica actor spawned."""
    import os

    import psutil

    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
    procs = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline()):
                procs.append(p)
        except psutil.NoSuchProcess:
            pass
    return procs


def test_a_dead_engine_hands_its_sequences_back_and_none_fails(client, fresh_policy):
    """vLLM's EngineCore process dies under a replica (what a GPU fault or an OOM kill does): its
    sequences must not end with errors. The replica says goodbye with their tokens, the survivor
    continues them, and Serve replaces the replica (its health check fails)."""
    import signal

    fresh_policy("pull")
    before = client.status()
    bid, lengths, victim_id, victim = batch_and_busiest_replica(client, 70)
    cores = engine_core_processes(victim)
    assert cores, "found no EngineCore process under the replica's actor"
    for p in cores:
        p.send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    while victim_id in client.status()["replicas"]:
        assert time.monotonic() - t0 < 30, "the replica with a dead engine did not leave"
        time.sleep(0.2)
    st = client.status()
    # by its goodbye (a timeout would be router.replica_timeout_s, 8 s here), counted as a death:
    # Serve replaces it, so the fleet the router expects keeps its size
    assert time.monotonic() - t0 < 7, "left by a replica timeout, not by its goodbye"
    assert st["counters"]["replica_deaths"] == before["counters"]["replica_deaths"] + 1
    assert st["counters"]["replica_leaves"] == before["counters"]["replica_leaves"]
    assert st["expected_replicas"] == before["expected_replicas"]
    results = collect(client, bid, len(lengths))
    assert [c.finish_reason for c in results] == ["length"] * len(lengths), [c.error for c in results if c.error]
    assert [len(c.token_ids) for c in results] == lengths
    assert all(len(c.logprobs) == len(c.token_ids) for c in results)
    resumed = [c for c in results if victim_id in c.replicas and len(c.replicas) > 1]
    assert resumed, "the dead engine's sequences should have continued on the survivor"
    assert all(any(m.source == victim_id and m.reason == "replica_lost" for m in c.migrations) for c in resumed)
