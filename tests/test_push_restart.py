"""Pushed weights across a router restart (docs/architecture.md, "Weights without a filesystem"):
a restarted router has lost the buckets' handles, but a replica that loaded the push, or was
noted it while asleep, kept them, and reloads from them when the restarted router's order names
the same push without handles."""
import asyncio

from rollout_cluster.config import ClusterConfig, EngineConfig, PolicyConfig
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import LoadWeights, ModelInfo, NoteWeights, Sleep, Wake
from rollout_cluster.router.core import RouterCore
from rollout_cluster.serve.engine_moves import EngineMoves
from rollout_cluster.transfer.buckets import pack
from rollout_cluster.transfer.push import PUSH_SCHEME

from test_fleet_sleep import COST, pull
from test_push_weights import TensorEngine, tensors

PUSH = f"{PUSH_SCHEME}p1"


def restarted_router_order(level: int, version: int, noted: bool):
    """The order a router restarted while replica "a" slept at `level` sends it at wake (with
    `noted`, "a" holds the push p0 as version - 1 and was noted `version`)."""
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=1)
    held = (dict(version=version - 1, path=f"{PUSH_SCHEME}p0", noted=(version, PUSH)) if noted
            else dict(version=version, path=PUSH))
    pull(core, "a", 0.0, level=level, model=ModelInfo(100, 64), **held)
    assert core.weights_status()["version"] == version and core.sleep_status()["level"] == level
    core.wake_fleet()
    return [c for c in pull(core, "a", 0.1, level=level, **held).control if isinstance(c, (Wake, LoadWeights))]


def test_a_deep_sleeper_reloads_its_own_pushed_buckets_when_a_restarted_router_wakes_it():
    wake = restarted_router_order(2, 4, noted=False)
    assert wake == [Wake(PUSH, 4, None)]  # the restarted router names the push, without its handles
    eng = TensorEngine()
    moves = EngineMoves(eng, ClusterConfig(engine=EngineConfig(model="models/none")), "a")
    buckets = tuple(pack(tensors(), bucket_bytes=1200))

    async def go():
        moves.apply(LoadWeights(PUSH, 4, buckets))
        await moves.loading[1]
        eng.loaded.clear()
        moves.apply(Sleep(2))
        await moves.sleep_task
        moves.apply(wake[0])
        await moves.sleep_task

    asyncio.run(go())
    assert moves.broken is None and moves.sleep_error is None and moves.weights_error is None
    assert [n for b in eng.loaded for n, _ in b] == [n for n, _ in tensors()]
    assert moves.sleep_level == 0 and moves.weights_version == 4


def test_a_push_noted_while_asleep_loads_from_the_notes_buckets_after_a_router_restart():
    buckets = tuple(pack(tensors(), bucket_bytes=1200))
    for level in (1, 2):
        eng = TensorEngine()
        moves = EngineMoves(eng, ClusterConfig(engine=EngineConfig(model="models/none")), "a")
        wake = restarted_router_order(level, 5, noted=True)
        assert wake == [Wake(PUSH, 5, None)]

        async def go():
            moves.apply(LoadWeights(f"{PUSH_SCHEME}p0", 4, buckets))  # what a level-2 sleeper drops
            await moves.loading[1]
            eng.loaded.clear()
            moves.apply(Sleep(level))
            await moves.sleep_task
            moves.apply(NoteWeights(PUSH, 5, buckets))  # the old router's note, with the handles
            moves.apply(wake[0])
            await moves.sleep_task
            if level == 1:  # awake now: the restarted router orders the load, without the handles
                moves.apply(LoadWeights(PUSH, 5, None))
                await moves.loading[1]

        asyncio.run(go())
        assert moves.broken is None and moves.weights_error is None, (level, moves.weights_error)
        assert moves.weights_version == 5 and [n for b in eng.loaded for n, _ in b] == [n for n, _ in tensors()]
