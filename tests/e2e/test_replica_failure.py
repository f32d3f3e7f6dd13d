"""A replica dies mid-batch (its actor is killed): every one of its sequences completes
elsewhere from its last reported tokens. Runs last: the cluster then waits for Serve's
replacement replica."""
import time

import pytest
import ray

from rollout_cluster.driver import expand
from rollout_cluster.types import SamplingSpec

pytestmark = pytest.mark.e2e


def engine_replica_actors():
    return [a for a in ray.util.list_named_actors(all_namespaces=True)
            if "EngineReplica" in a["name"]]


def test_killed_replica_work_completes_elsewhere(client, fresh_policy):
    fresh_policy("pull")
    lengths = [600] * 8 + [300] * 8
    prompts = [[30 + i, 31, 32] for i in range(len(lengths))]
    requests = expand(prompts, [SamplingSpec(max_tokens=n, ignore_eos=True, logprobs=0) for n in lengths])
    bid = client.submit(requests)
    time.sleep(1.0)
    st = client.status()
    victim_id = max(st["replicas"], key=lambda r: st["replicas"][r]["running"])
    assert st["replicas"][victim_id]["running"] > 0
    (victim,) = [a for a in engine_replica_actors() if victim_id in a["name"]]
    ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=True)
    results, cursor, done = [None] * len(requests), 0, False
    deadline = time.monotonic() + 600
    while not done:
        assert time.monotonic() < deadline
        new, cursor, done = client.router.fetch.remote(bid, cursor, 1.0).result(timeout_s=60)
        for c in new:
            assert results[c.index] is None  # never twice
            results[c.index] = c
    assert [len(c.token_ids) for c in results] == lengths
    assert all(len(c.logprobs) == len(c.token_ids) for c in results)
    resumed = [c for c in results if victim_id in c.replicas and len(c.replicas) > 1]
    assert resumed, "the killed replica's sequences should have continued on the survivor"
    assert client.status()["counters"]["replica_deaths"] >= 1
