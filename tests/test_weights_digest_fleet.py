"""RolloutClient.weights_digest's path without Ray: the router orders a digest once per replica
(router/digests.py), keeps the answers to its latest ask and refuses during a load or sleep; a
replica takes one digest per ask after the moves under way, and answers an error, never a digest,
when a load overlaps it (serve/engine_moves.py); the simulated engine answers deterministically."""
import asyncio

import pytest

from rollout_cluster.config import ClusterConfig, EngineConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.engines.sim_engine import SimEngine
from rollout_cluster.protocol import (DigestWeights, EngineStats, LoadWeights, Report, SleepState, WeightsDigest,
                                      WeightsState)
from rollout_cluster.serve.engine_moves import EngineMoves

from test_fleet_sleep import asleep, core_with, pull


def digests(orders):
    return [c for c in orders.control if isinstance(c, DigestWeights)]


def answer(core, rid, now, digest, version=0):
    return core.on_report(Report(rid, "i1", stats=EngineStats(), capacity=8, weights=WeightsState(version=version),
                                 sleep=SleepState(), digest=digest), now)


def test_every_replica_gets_one_order_and_the_answers_of_the_latest_ask_are_kept():
    core = core_with(("a", "b"))
    old = core.digests.request()
    ask = core.digests.request(detail=True)  # before anyone pulled: the newer replaces the older
    assert ask != old
    for rid in ("a", "b"):
        assert digests(pull(core, rid, 1.0)) == [DigestWeights(ask, True)]
        assert digests(pull(core, rid, 2.0)) == []  # delivered once
    assert core.digests.answers(ask)["waiting"] == ["a", "b"]
    answer(core, "a", 3.0, WeightsDigest(old, 0, "ffff"))  # an answer to another ask is not taken
    answer(core, "a", 3.1, WeightsDigest(ask, 0, "abcd", {"w": {"digest": "abcd", "dtype": "bf16", "shape": [1]}}))
    got = core.digests.answers(ask)
    assert got["waiting"] == ["b"] and got["replicas"]["a"]["digest"] == "abcd"
    assert got["replicas"]["a"]["params"]["w"]["shape"] == [1]
    core.remove_replica("b", 4.0)  # it died: nobody waits for it
    assert core.digests.answers(ask)["waiting"] == []
    with pytest.raises(KeyError, match="not the latest"):
        core.digests.answers(old)


def test_a_digest_is_refused_during_a_load_and_while_asleep():
    core = core_with(("a", "b"))
    core.update_weights("/ckpt/1")
    with pytest.raises(RuntimeError, match=r"weights_digest: replica\(s\) a, b still load weights"):
        core.digests.request()
    for rid in ("a", "b"):
        pull(core, rid, 1.0, version=1)
    assert core.digests.request()  # settled
    with pytest.raises(TypeError, match="detail='yes'"):
        core.digests.request(detail="yes")
    asleep(core)
    with pytest.raises(RuntimeError, match="sleeps"):
        core.digests.request()


class SlowLoads(SimEngine):
    """A sim engine whose loads and digests take time, to overlap them."""

    async def load_weights(self, path, keep_as=None):
        await asyncio.sleep(0.05)
        await super().load_weights(path, keep_as)

    async def weights_digest(self, detail=False):
        await asyncio.sleep(0.05)
        return await super().weights_digest(detail)


def moves_of():
    eng = SlowLoads(load_profile("h200-1.5b", max_num_seqs=8))
    return eng, EngineMoves(eng, ClusterConfig(engine=EngineConfig(model="models/none")), "a")


def test_a_replica_digests_after_a_load_under_way_once_per_ask():
    eng, moves = moves_of()

    async def go():
        moves.apply(LoadWeights("/ckpt/1", 1))
        moves.apply(DigestWeights("d1", detail=True))
        await asyncio.sleep(0.2)
        first = moves.digest
        moves.digest_delivered(first)
        moves.apply(DigestWeights("d1", detail=True))  # resent (a lost reply): nothing more
        await asyncio.sleep(0.1)
        return first

    first = asyncio.run(go())
    assert first.ask == "d1" and first.version == 1 and first.error is None and len(first.digest) == 16
    assert first.params and moves.digest is None


def test_a_load_that_overlaps_the_digest_makes_it_an_error():
    eng, moves = moves_of()

    async def go():
        moves.apply(DigestWeights("d1"))
        await asyncio.sleep(0.01)  # the digest runs
        moves.apply(LoadWeights("/ckpt/2", 2))
        await asyncio.sleep(0.2)

    asyncio.run(go())
    assert moves.digest.digest == "" and "a weights load or a sleep began during the digest" in moves.digest.error
    assert moves.weights_version == 2


def test_the_simulated_engine_answers_what_it_loaded():
    async def digest_after(load):
        eng = SimEngine(load_profile("h200-1.5b", max_num_seqs=8))
        await load(eng)
        return (await eng.weights_digest())["digest"]

    async def ckpt(path):
        return await digest_after(lambda e: e.load_weights(path))

    async def push(names):
        return await digest_after(lambda e: e.load_tensors([[(n, None) for n in names]]))

    async def go():
        return (await ckpt("/c/1"), await ckpt("/c/1"), await ckpt("/c/2"), await push(["x", "y"]),
                await push(["x", "y"]), await push(["x"]))

    c1, c1_again, c2, p1, p1_again, p2 = asyncio.run(go())
    assert c1 == c1_again and p1 == p1_again and len({c1, c2, p1, p2}) == 4


def test_a_pull_loop_sends_the_answer_until_a_pull_delivers_it():
    from rollout_cluster.config import RouterConfig
    from rollout_cluster.serve.pull_loop import PullLoop

    eng, moves = moves_of()
    moves.digest = WeightsDigest("d1", 0, "abcd")
    sent = []

    async def router(report):
        sent.append(report.digest)
        if len(sent) == 1:
            raise ConnectionError("lost")
        from rollout_cluster.protocol import Orders
        return Orders()

    loop = PullLoop(eng, moves, router, replica_id="a", incarnation="i", model=None, router_cfg=RouterConfig())

    async def go():
        for _ in range(3):
            await loop.pull(loop.build_report(0.0))

    asyncio.run(go())
    assert [d and d.digest for d in sent] == ["abcd", "abcd", None]
