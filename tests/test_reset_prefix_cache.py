"""reset_prefix_cache (TRL's /reset_prefix_cache): the router orders it once per replica, a replica
drops its cache once per order (a resent order starts nothing), after any move under way, and a
simulated engine's free pool empties while what running sequences hold stays."""
import asyncio

from rollout_cluster.config import ClusterConfig, EngineConfig
from rollout_cluster.engines.prefix_cache import PrefixCache
from rollout_cluster.protocol import LoadWeights, ResetPrefixCache
from rollout_cluster.serve.engine_moves import EngineMoves

from test_fleet_sleep import core_with, pull


def resets(orders):
    return [c for c in orders.control if isinstance(c, ResetPrefixCache)]


def test_every_replica_gets_one_order_and_two_resets_before_a_pull_are_one():
    core = core_with(("a", "b", "c"))
    assert core.reset_prefix_cache() == 3
    assert core.reset_prefix_cache() == 3  # before anyone pulled: the newer replaces the older
    for rid in ("a", "b", "c"):
        assert resets(pull(core, rid, 1.0)) == [ResetPrefixCache(2)]
        assert resets(pull(core, rid, 2.0)) == []  # delivered once
    assert core.reset_prefix_cache() == 3
    assert resets(pull(core, "b", 3.0)) == [ResetPrefixCache(3)]


class CacheEngine:
    def __init__(self):
        self.calls = []

    async def reset_prefix_cache(self):
        self.calls.append("reset")
        return True

    async def load_weights(self, path, keep_as=None):
        self.calls.append("load-start")
        await asyncio.sleep(0.02)
        self.calls.append("load-end")


def test_a_replica_resets_once_per_order_and_after_a_load_under_way():
    eng = CacheEngine()
    moves = EngineMoves(eng, ClusterConfig(engine=EngineConfig(model="models/none")), "a")

    async def go():
        moves.apply(LoadWeights("/ckpt/1", 1))
        moves.apply(ResetPrefixCache(1))
        moves.apply(ResetPrefixCache(1))  # resent (a lost reply): nothing more
        await asyncio.sleep(0.1)
        moves.apply(ResetPrefixCache(2))
        await asyncio.sleep(0.02)

    asyncio.run(go())
    assert eng.calls == ["load-start", "load-end", "reset", "reset"]


def test_the_simulated_cache_drops_its_free_pool_and_keeps_held_prompts():
    cache = PrefixCache(kv_tokens=1000)
    cache.admit(("g", 0), 10, ("seq", "s0"), 10)  # running: holds its group's prompt
    cache.admit(("g", 1), 20, ("seq", "s1"), 20)
    cache.release(("g", 1), 20, ("seq", "s1"), 25)  # finished: prompt and context go to the free pool
    assert cache.free_tokens == 45
    cache.drop_free()
    assert cache.free_tokens == 0 and not cache.free
    assert cache.admit(("g", 1), 20, ("seq", "s2"), 20) == 0  # dropped: a miss
    assert cache.admit(("g", 0), 10, ("seq", "s3"), 10) == 10  # still held by s0: a hit
