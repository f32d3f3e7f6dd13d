"""How a replica's last load handed its buckets to vLLM's worker ("store": where they lie in Ray's
object store, "slot": copied into a /dev/shm slot, "file", "bytes", "ipc"), seam by seam:
weight_loader.load_into counts it, VllmWeights and EngineMoves keep it with the weights loaded,
WeightsState carries it, the router keeps it per replica and status()["weights"]["handed"] shows
it. A silent fallback from the store to slots shows here. On the cluster:
tests/e2e/test_push_weights_vllm.py (every replica's push went through "store")."""
import asyncio
import pickle
import time

import torch

from rollout_cluster.config import ClusterConfig, EngineConfig
from rollout_cluster.engines import store_views, weight_keep
from rollout_cluster.engines.vllm_engine import VllmEngine
from rollout_cluster.engines.vllm_weights import VllmWeights
from rollout_cluster.engines.weight_loader import WAYS, load_into
from rollout_cluster.protocol import EngineStats, LoadWeights, ModelInfo, Report, SleepState, Sleep, Wake, WeightsState
from rollout_cluster.serve.engine_moves import EngineMoves
from rollout_cluster.transfer.buckets import pack
from rollout_cluster.transfer.push import PUSH_SCHEME

from test_fleet_sleep import core_with
from test_push_weights import TensorEngine, tensors
from test_router_status import bare_router
from test_shm_slots import Engine
from test_store_views import Store, pushed


def only(**counts) -> dict:
    return {**dict.fromkeys(WAYS, 0), **counts}


# ---- weight_loader.load_into ----------------------------------------------------------------------
def test_buckets_read_in_the_store_are_counted_store_and_heap_buckets_slot():
    store, eng = Store(), Engine()
    _, buckets = pushed(store, 1.0)
    handed = {"left": 9}  # whatever it held is replaced
    assert asyncio.run(load_into(eng, buckets, None, handed=handed)) == 3
    assert handed == only(store=3)
    heap = [[("h", torch.full((500,), 3.0))], [("g", torch.ones(7))]]  # not the store's memory
    asyncio.run(load_into(eng, heap, None, handed=handed))
    assert handed == only(slot=2)  # the last load's alone


def test_a_worker_that_cannot_map_the_store_shows_as_slot_buckets(monkeypatch):
    def refused(region):
        raise PermissionError(1, "Operation not permitted", region["path"])

    monkeypatch.setattr(store_views, "open_region", refused)
    store, eng = Store(), Engine()
    _, buckets = pushed(store, 2.0)
    handed: dict = {}
    asyncio.run(load_into(eng, buckets, None, handed=handed))
    assert handed == only(slot=3)  # the silent fallback, counted


def test_the_file_and_bytes_transports_are_counted_as_such():
    for transport in ("file", "bytes"):
        handed: dict = {}
        asyncio.run(load_into(Engine(), [[("a", torch.ones(5))], [("b", torch.ones(3))]], None, transport, handed))
        assert handed == only(**{transport: 2}), transport


# ---- VllmWeights (VllmEngine.handed) ---------------------------------------------------------------
class Seqs:
    tasks: dict = {}


class RpcEngine(Engine):
    """test_shm_slots' stand-in worker, with what VllmWeights asks besides the load."""

    async def reset_prefix_cache(self):
        return True

    async def collective_rpc(self, method, args=(), kwargs=None):
        if method.startswith("rc_swap_"):  # a keep swap: staged and applied whole
            return [{"missing": [], "sampled": {}}] if method == "rc_swap_apply" else [1]
        if method == "reload_weights":
            return [None]
        return await super().collective_rpc(method, args)


def test_the_vllm_engine_keeps_how_its_last_load_was_handed(tmp_path, monkeypatch):
    monkeypatch.setattr("rollout_cluster.engines.vllm_weights.check_checkpoint", lambda path, manifest: None)
    owner = object.__new__(VllmEngine)
    owner.engine, owner.cfg = RpcEngine(), EngineConfig(model=str(tmp_path))
    owner.weights = w = VllmWeights(owner, Seqs(), str(tmp_path))
    assert owner.handed() == {}  # no load yet
    _, buckets = pushed(Store(), 1.0)
    asyncio.run(w.load_tensors(buckets))
    assert owner.handed() == only(store=3)
    w.seqs.open_fence = w.seqs.close_fence = lambda: None
    w.seqs.swapped = lambda sampled, version: None
    asyncio.run(w.load_tensors([[("a", torch.ones(2))]], keep_as=5))  # a keep swap stages files
    assert owner.handed() == only(file=1)
    asyncio.run(w.load_weights(str(tmp_path)))  # vLLM read the checkpoint itself: none handed
    assert owner.handed() == {}


def test_a_keep_swap_counts_each_staged_bucket_a_file():
    handed: dict = {}
    asyncio.run(weight_keep.swap_into(RpcEngine(), [[("a", torch.ones(2))], [("b", torch.ones(2))]], None,
                                      handed=handed))
    assert handed == only(file=2)


# ---- EngineMoves --------------------------------------------------------------------------------------
class CountingEngine(TensorEngine):
    """Loads as TensorEngine; says each load went through the way `ways` names next."""

    def __init__(self, *ways):
        super().__init__()
        self.ways, self.last = list(ways), {}

    async def load_tensors(self, buckets, keep_as=None):
        way = self.ways.pop(0)
        if way == "fail":
            raise RuntimeError("refused")
        n = await super().load_tensors(buckets, keep_as)
        self.last = only(**{way: len(self.loaded)})
        return n

    def handed(self):
        return self.last


def test_the_replica_reports_how_the_weights_it_holds_were_handed_and_a_deep_wake_counts_again():
    eng = CountingEngine("store", "fail", "slot")
    moves = EngineMoves(eng, ClusterConfig(engine=EngineConfig(model="models/none")), "a")
    buckets = tuple(pack(tensors(), bucket_bytes=1200))

    async def go():
        moves.apply(LoadWeights(f"{PUSH_SCHEME}p", 4, buckets))
        await moves.loading[1]
        held = moves.states()[0].handed
        eng.loaded.clear()
        moves.apply(LoadWeights(f"{PUSH_SCHEME}q", 5, buckets))  # fails: the weights held stay, and how they came
        await moves.loading[1]
        failed = moves.states()[0].handed
        moves.apply(Sleep(2))
        await moves.sleep_task
        moves.apply(Wake(None, 4))  # the level-2 wake reloads version 4 through load_into again
        await moves.sleep_task
        return held, failed

    held, failed = asyncio.run(go())
    n = len(buckets)
    assert held == failed == only(store=n) and moves.weights_version == 4
    assert moves.states()[0].handed == only(slot=n)  # the wake's reload, not the first load
    assert EngineMoves(object(), ClusterConfig(), "b").states()[0].handed == {}  # an engine that does not count


# ---- the router and status() -------------------------------------------------------------------------
def report(core, rid, now, version, path, handed=None, **kw):
    w = WeightsState(version=version, path=path, **({} if handed is None else {"handed": handed}))
    return core.on_report(Report(rid, "i1", progress=[], stats=EngineStats(), capacity=8, weights=w,
                                 sleep=SleepState(), **kw), now)


def test_the_router_keeps_each_replicas_handed_and_status_shows_it():
    core = core_with(("a", "b"))
    report(core, "a", 1.0, 0, "", handed=only(store=3))
    report(core, "b", 1.0, 0, "", handed={"slot": 2, "store": True, 7: 1, "bytes": -1})  # only counts are kept
    assert core.weights_status()["handed"] == {"a": only(store=3), "b": {"slot": 2}}
    report(core, "a", 1.1, 0, "")  # none counted for the same weights (a goodbye's): the known one stays
    assert core.weights_status()["handed"]["a"] == only(store=3)
    report(core, "a", 1.2, 1, "/ckpt/1")  # other weights, none counted (vLLM read them itself)
    assert core.weights_status()["handed"]["a"] == {}
    old = WeightsState(version=1, path="/ckpt/1", handed=only(slot=1))
    del old.__dict__["handed"]  # pickled by a replica older than the field
    assert pickle.loads(pickle.dumps(old)).handed_counts() == {}


def test_status_shows_the_weights_handed_per_replica():
    r = bare_router()
    report(r.core, "a", time.monotonic(), 0, "", handed=only(store=2), model=ModelInfo(100, 64))
    st = asyncio.run(r.status())
    assert st["weights"]["handed"] == {"a": only(store=2)}
