"""push_weights without Ray's object store: buckets pack and unpack every dtype exactly; the
router orders a push's buckets to every replica, to joiners, with a note while asleep and with the
wake of a level-2 sleeper; a replica loads them in place, one bucket fetched ahead, and reloads
them after a deep sleep; the Serve Router refuses a push whose object ids differ from the signed
ones. The real path (object store, vLLM engines): tests/e2e/test_push_weights.py."""
import asyncio
import re

import pytest
import torch

from rollout_cluster.config import ClusterConfig, EngineConfig, to_dict
from rollout_cluster.protocol import InputError, LoadWeights, NoteWeights, Report, Sleep, Wake
from rollout_cluster.serve.engine_moves import EngineMoves, fetched
from rollout_cluster.transfer.buckets import pack, plan, unpack
from rollout_cluster.transfer.push import PUSH_SCHEME

from router_support import SIGNER, pull as signed_pull
from test_fleet_sleep import core_with, pull


def tensors():
    g = torch.Generator().manual_seed(0)
    return [("embed.weight", torch.randn(64, 16, generator=g).to(torch.bfloat16)),
            ("layers.0.w", torch.randn(16, 16, generator=g)),
            ("layers.0.b", torch.arange(16, dtype=torch.float16)),
            ("scale", torch.tensor(3.0, dtype=torch.float64)),
            ("empty", torch.zeros(0, 4))]


def test_buckets_hold_about_the_size_asked_and_give_back_every_tensor_exactly():
    named = tensors()
    buckets = list(pack(named, bucket_bytes=1200))
    assert len(buckets) >= 2 and all(sum(d.nbytes for d in b["data"]) <= 2048 for b in buckets)
    back = [pair for b in buckets for pair in unpack(b)]
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, a), (_, b) in zip(named, back):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("bad, message", [
    ([("w", [1.0])], "expected a torch.Tensor"),
    ([("w", torch.ones(1)), ("w", torch.ones(1))], "given twice"),
    (["w"], "(name, tensor) pairs"),
    ([("w", torch.ones(1)), ("m", torch.empty(3, device="meta"))], "named_tensors['m']: a meta tensor has no data"),
    ([("s", torch.eye(3).to_sparse())], "named_tensors['s']: layout torch.sparse_coo: only dense"),
])
def test_bad_tensors_are_named(bad, message):
    """Each refused with its name, in pack (the default push) and in plan (a streamed push plans every
    tensor before its order: a tensor that cannot be packed fails it before any replica is ordered)."""
    for way in (pack, plan):
        with pytest.raises((TypeError, ValueError), match=re.escape(message)):
            list(way(bad))


def test_a_dtensor_is_refused_naming_it_and_how_to_push_it():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        shard = distribute_tensor(torch.ones(4, 2), init_device_mesh("cpu", (1,)), [Shard(0)])
        for way in (pack, plan):
            with pytest.raises(TypeError, match=re.escape("named_tensors['d']: a DTensor (sharded across ranks)")):
                list(way([("d", shard)]))
    finally:
        dist.destroy_process_group()


def loads(orders):
    return [c for c in orders.control if isinstance(c, (LoadWeights, NoteWeights))]


def test_the_router_sends_a_pushs_buckets_to_every_replica_and_to_joiners():
    core = core_with(("a", "b"))
    handles = ("ref-0", "ref-1")
    v = core.update_weights(f"{PUSH_SCHEME}p1", None, handles)
    assert v == 1
    for rid in ("a", "b"):
        assert loads(pull(core, rid, 1.0)) == [LoadWeights(f"{PUSH_SCHEME}p1", 1, handles)]
    pull(core, "a", 2.0, version=1, path=f"{PUSH_SCHEME}p1")
    from rollout_cluster.protocol import ModelInfo
    assert loads(pull(core, "c", 2.0, model=ModelInfo(100, 64))) == [LoadWeights(f"{PUSH_SCHEME}p1", 1, handles)]
    # a checkpoint after it carries no buckets
    pull(core, "b", 2.5, version=1, path=f"{PUSH_SCHEME}p1")
    pull(core, "c", 2.5, version=1, path=f"{PUSH_SCHEME}p1")
    core.update_weights("/ckpt/2")
    assert loads(pull(core, "a", 3.0)) == [LoadWeights("/ckpt/2", 2, None)]


def test_asleep_the_note_and_a_deep_wake_carry_the_buckets():
    core = core_with(("a",))
    core.sleep_fleet(2)
    assert [c for c in pull(core, "a", 0.5).control if isinstance(c, Sleep)] == [Sleep(2)]
    pull(core, "a", 0.6, level=2)
    core.update_weights(f"{PUSH_SCHEME}p2", None, ("r",))
    assert loads(pull(core, "a", 1.0, level=2)) == [NoteWeights(f"{PUSH_SCHEME}p2", 1, ("r",))]
    core.wake_fleet()
    wake = [c for c in pull(core, "a", 1.5, level=2, noted=(1, f"{PUSH_SCHEME}p2")).control if isinstance(c, Wake)]
    assert wake == [Wake(f"{PUSH_SCHEME}p2", 1, ("r",))]


class TensorEngine:
    def __init__(self):
        self.loaded, self.asleep = [], 0

    async def load_tensors(self, buckets, keep_as=None):
        async for bucket in buckets:
            self.loaded.append([(n, t.clone()) for n, t in bucket])
        return sum(len(b) for b in self.loaded)

    async def load_weights(self, path, keep_as=None):
        raise AssertionError("a push loads no checkpoint")

    async def sleep(self, level):
        self.asleep = level

    async def wake(self):
        self.asleep = 0

    async def sleeping(self):
        return bool(self.asleep)


def test_a_replica_loads_the_buckets_in_order_and_reloads_them_after_a_deep_sleep():
    eng = TensorEngine()
    moves = EngineMoves(eng, ClusterConfig(engine=EngineConfig(model="models/none")), "a")
    buckets = tuple(pack(tensors(), bucket_bytes=1200))

    async def go():
        moves.apply(LoadWeights(f"{PUSH_SCHEME}p", 4, buckets))
        await moves.loading[1]
        assert (moves.weights_version, moves.weights_path, moves.weights_error) == (4, f"{PUSH_SCHEME}p", None)
        first = [n for b in eng.loaded for n, _ in b]
        eng.loaded.clear()
        moves.apply(Sleep(2))
        await moves.sleep_task
        moves.apply(Wake(None, 4))  # a router that lost the buckets' handles: the replica's own
        await moves.sleep_task
        return first

    first = asyncio.run(go())
    assert first == [n for n, _ in tensors()] == [n for b in eng.loaded for n, _ in b]
    assert moves.sleep_level == 0 and moves.broken is None


def test_a_replica_lets_a_replaced_push_go_once_the_next_one_is_loaded():
    """After a push's load the replica keeps only the handles of the version it holds: Ray frees a
    replaced version's buckets (with two kept, a 7B model's third push filled an H200 host's
    object store and spilled it to a full disk). A push that failed to load is let go too."""
    import gc
    import weakref

    eng = TensorEngine()
    moves = EngineMoves(eng, ClusterConfig(engine=EngineConfig(model="models/none")), "a")
    buckets = tuple(pack(tensors(), bucket_bytes=1200))

    async def load(path, version, named):
        moves.apply(LoadWeights(path, version, named))
        await moves.loading[1]

    async def go():
        await load(f"{PUSH_SCHEME}p1", 1, buckets)
        first = weakref.ref(moves.streams[f"{PUSH_SCHEME}p1"])
        await load(f"{PUSH_SCHEME}p2", 2, buckets)
        assert set(moves.streams) == {f"{PUSH_SCHEME}p2"} and moves.weights_version == 2
        assert moves.weights_buckets is moves.streams[f"{PUSH_SCHEME}p2"]  # (a deep sleep's reload)
        gc.collect()
        assert first() is None  # nothing else holds p1's handles
        await load(f"{PUSH_SCHEME}p3", 3, (None,) + buckets[1:])  # a bucket that is no bucket: the load fails
        assert moves.weights_version == 2 and "p3" in moves.weights_error
        assert set(moves.streams) == {f"{PUSH_SCHEME}p2"}

    asyncio.run(go())


def test_a_push_whose_tensors_are_gone_fails_with_why():
    moves = EngineMoves(TensorEngine(), ClusterConfig(engine=EngineConfig(model="models/none")), "a")

    async def go():
        moves.apply(LoadWeights(f"{PUSH_SCHEME}p", 2, None))
        await moves.loading[1]

    asyncio.run(go())
    assert "push the weights again" in moves.weights_error and moves.weights_version == 0


def test_fetching_runs_one_bucket_ahead_and_stops_on_a_failure():
    started = []

    class Ref:
        def __init__(self, i, fail=False):
            self.i, self.fail = i, fail

        def __await__(self):
            started.append(self.i)
            yield from asyncio.sleep(0).__await__()
            if self.fail:
                raise RuntimeError(f"bucket {self.i} lost")
            return {"names": [f"t{self.i}"], "dtypes": ["float32"], "shapes": [[1]],
                    "data": [torch.ones(1).view(torch.uint8).numpy()]}

    async def go(refs):
        out = []
        async for b in fetched(refs):
            out.append((b[0][0], list(started)))
        return out

    got = asyncio.run(go((Ref(0), Ref(1), Ref(2))))
    assert [n for n, _ in got] == ["t0", "t1", "t2"] and got[0][1] == [0, 1]  # bucket 1 asked before 0 loaded
    started.clear()
    with pytest.raises(RuntimeError, match="bucket 1 lost"):
        asyncio.run(go((Ref(0), Ref(1, fail=True), Ref(2))))


class FakeRef:
    def __init__(self, h):
        self.h = h

    def hex(self):
        return self.h


def test_the_serve_router_takes_only_the_buckets_the_order_names():
    async def go():
        from rollout_cluster.serve.router import Router

        router = Router.func_or_class(to_dict(ClusterConfig(replicas=1, engine={"kind": "sim"})))
        try:
            await signed_pull(router, Report("a", "a-1", capacity=4))
            refs = [FakeRef("aa"), FakeRef("bb")]
            args = {"source": f"{PUSH_SCHEME}x", "version": None, "buckets": ["aa", "bb"], "tensors": 3, "bytes": 10}
            with pytest.raises(InputError, match="buckets"):
                await router.push_weights(SIGNER.sign("push_weights", args), refs[::-1])
            with pytest.raises(InputError, match="source"):
                await router.push_weights(SIGNER.sign("push_weights", {**args, "source": "/etc"}), refs)
            assert await router.push_weights(SIGNER.sign("push_weights", args), refs) == 1
            assert router.core.weights.buckets == tuple(refs)
            assert router.verifier.refusals["malformed"] == 1
        finally:
            router._reaper.cancel()

    asyncio.run(go())
