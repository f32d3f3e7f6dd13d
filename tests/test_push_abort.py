"""A streamed push its trainer aborts (push_abort): the trainer that fails between its order and
its last bucket tells the router, the fleet goes back to the weights it held before, each replica's
load of the push stops at once, and a replica whose engine had begun replacing its weights reloads
the ones it held (from its push's buckets, its checkpoint or the config's model) instead of waiting
bucket_stream.STALL_S and restarting. The real path: tests/e2e/test_push_weights_vllm.py."""
import asyncio

import pytest
import torch

from rollout_cluster.config import ClusterConfig, EngineConfig
from rollout_cluster.engines.base import WeightsLoadBroken
from rollout_cluster.protocol import InputError, LoadWeights, ModelInfo, NoteWeights, StopPush
from rollout_cluster.serve.engine_moves import EngineMoves
from rollout_cluster.transfer import push as push_mod
from rollout_cluster.transfer.bucket_stream import BucketStream, BucketsStopped
from rollout_cluster.transfer.buckets import header, is_manifest, manifest, pack
from rollout_cluster.transfer.push import PUSH_SCHEME

from test_fleet_sleep import batch, core_with, pull

SRC, OTHER = f"{PUSH_SCHEME}s1", f"{PUSH_SCHEME}s2"


def controls(orders):
    return [c for c in orders.control if isinstance(c, (LoadWeights, NoteWeights, StopPush))]


def at_checkpoint_then_streaming():
    """Replicas a, b hold checkpoint /ck/1 (version 1); a streamed push of 4 objects came with 2 of
    them as version 2: a took its order and loads, b's order still waits in its outbox."""
    core = core_with(("a", "b"))
    core.update_weights("/ck/1")
    for rid in ("a", "b"):
        pull(core, rid, 0.5)
        pull(core, rid, 0.6, version=1, path="/ck/1")
    assert core.update_weights(SRC, None, ("m", "b0"), total=4) == 2
    assert controls(pull(core, "a", 1.0, version=1, path="/ck/1")) == [LoadWeights(SRC, 2, ("m", "b0"))]
    return core


# ---- the router ---------------------------------------------------------------------------------
def test_an_aborted_push_sends_the_fleet_back_and_stops_every_replicas_load_of_it():
    core = at_checkpoint_then_streaming()
    bid = batch(core, 1.1)  # submitted meanwhile: opened on version 2, which no replica can hold now
    assert core.batches.get(bid).weights_version == 2
    assert core.abort_push(SRC, "the trainer's push failed: OSError: disk") == {"aborted": 2, "version": 1}
    st = core.weights_status()
    assert (st["version"], st["path"], st["streaming"]) == (1, "/ck/1", False)
    assert st["aborted"] == {"version": 2, "source": SRC, "reason": "the trainer's push failed: OSError: disk",
                             "back_to": 1}
    stop = StopPush(SRC, "the trainer's push failed: OSError: disk")
    assert controls(pull(core, "a", 1.2, version=1, path="/ck/1", loading=2)) == [stop]  # it stops its load
    at_b = pull(core, "b", 1.3, version=1, path="/ck/1")
    assert controls(at_b) == [stop]  # its waiting order is gone
    # b holds version 1 and loads nothing: usable again, the batch runs on it (a still loads)
    assert len(at_b.start) == 2 and core.batches.get(bid).weights_version == 1
    assert controls(pull(core, "c", 1.4, model=ModelInfo(100, 64))) == [LoadWeights("/ck/1", 1, None)]  # a joiner


def test_an_abort_is_taken_once_and_the_aborted_number_is_never_given_again():
    core = at_checkpoint_then_streaming()
    core.abort_push(SRC, "x")
    assert core.abort_push(SRC, "x") == {"aborted": None, "version": 1}  # (a retry of the abort)
    with pytest.raises(InputError, match="push the weights again"):  # its later buckets are refused
        core.control.push_more(SRC, 2, ("b1",))
    pull(core, "a", 2.0, version=1, path="/ck/1")  # a's load of 2 stopped; it reloaded version 1
    assert core.update_weights(OTHER, None, ("m", "b0")) == 3  # not 2: 2 named the aborted weights


def test_a_push_whose_objects_all_came_or_another_push_is_not_aborted():
    core = at_checkpoint_then_streaming()
    assert core.abort_push(OTHER, "x") == {"aborted": None, "version": 2}
    core.control.push_more(SRC, 2, ("b1", "b2"))  # all 4 came: the replicas may hold it now
    assert core.abort_push(SRC, "x") == {"aborted": None, "version": 2}
    assert core.weights_status()["streaming"] is False and core.weights_status()["aborted"] is None


def test_a_push_that_says_fewer_objects_than_it_sends_is_refused_naming_the_field():
    core = core_with(("a",))
    with pytest.raises(InputError, match="objects"):
        core.update_weights(SRC, None, ("m", "b0"), total=1)
    core.update_weights(SRC, None, ("m", "b0"), total=3)
    with pytest.raises(InputError, match="buckets"):  # more than the push said it has
        core.control.push_more(SRC, 2, ("b1", "b2"))


def test_an_abort_replaces_a_sleepers_note_of_the_push():
    core = core_with(("a",))
    core.update_weights("/ck/1")
    pull(core, "a", 0.2)
    pull(core, "a", 0.3, version=1, path="/ck/1")
    core.sleep_fleet(1)
    pull(core, "a", 0.5, version=1, path="/ck/1")
    pull(core, "a", 0.6, version=1, path="/ck/1", level=1)
    core.update_weights(SRC, None, ("m", "b0"), total=3)
    assert controls(pull(core, "a", 1.0, version=1, path="/ck/1", level=1)) == [NoteWeights(SRC, 2, ("m", "b0"))]
    core.abort_push(SRC, "x")
    assert controls(pull(core, "a", 1.1, version=1, path="/ck/1", level=1, noted=(2, SRC))) == [StopPush(SRC, "x")]


# ---- the replica --------------------------------------------------------------------------------
def pushed(value: float, n: int = 3) -> tuple:
    """A push's objects (its manifest, then one tensor a bucket, all `value`) and its tensors."""
    named = [(f"w{i}", torch.full((8,), value)) for i in range(n)]
    buckets = list(pack(named, bucket_bytes=32))
    return (manifest([header(b) for b in buckets]), *buckets), dict(named)


class MixingEngine:
    """Loads as vLLM's worker does: a failure once a bucket went in leaves a mix (WeightsLoadBroken)."""

    def __init__(self):
        self.weights: dict = {}  # name -> tensor, what the engine computes with
        self.checkpoints: list = []  # the checkpoints it loaded, in order
        self.took = asyncio.Event()

    async def load_tensors(self, buckets, keep_as=None):
        went_in = 0
        try:
            async for bucket in buckets:
                if not is_manifest(bucket):
                    for name, t in bucket:
                        self.weights[name] = torch.as_tensor(t).clone()
                        went_in += 1
                    self.took.set()
        except Exception as e:
            if went_in:
                raise WeightsLoadBroken(f"a mix of old and new: {type(e).__name__}: {e}") from e
            raise
        return went_in

    async def load_weights(self, path, keep_as=None):
        self.checkpoints.append(path)
        self.weights = {f"w{i}": torch.full((8,), -1.0) for i in range(3)}  # (the checkpoint's)


def moves_with(eng, model="models/none", kind=None):
    engine = EngineConfig(model=model) if kind is None else EngineConfig(model=model, kind=kind)
    return EngineMoves(eng, ClusterConfig(engine=engine), "a")


def stopped_midway(moves, eng, version=2) -> None:
    """A streamed push of 3 buckets (all 2.0) ordered with its manifest and first bucket; once that
    bucket went in, its trainer aborts it."""
    objects, _ = pushed(2.0)

    async def go():
        moves.apply(LoadWeights(OTHER, version, objects[:2]))
        eng.took.clear()
        await asyncio.wait_for(eng.took.wait(), 5)
        moves.apply(StopPush(OTHER, "the trainer's push failed: KeyboardInterrupt: "))
        await asyncio.wait_for(moves.loading[1], 5)  # at once, not after STALL_S (60 s)

    asyncio.run(go())


def test_a_replica_whose_push_stopped_halfway_reloads_the_push_it_held():
    eng = MixingEngine()
    moves = moves_with(eng)
    held, tensors = pushed(1.0)

    async def first():
        moves.apply(LoadWeights(SRC, 1, held))
        await moves.loading[1]

    asyncio.run(first())
    stopped_midway(moves, eng)
    assert moves.broken is None and (moves.weights_version, moves.weights_path) == (1, SRC)
    assert all(torch.equal(eng.weights[n], t) for n, t in tensors.items())  # the held push's, whole again
    assert "KeyboardInterrupt" in moves.weights_error and "reloaded version 1" in moves.weights_error
    assert moves.weights_error_version == 2 and set(moves.streams) == {SRC}  # the aborted push let go


def test_a_replica_reloads_its_checkpoint_or_the_config_model_after_a_stopped_push(tmp_path):
    eng = MixingEngine()
    moves = moves_with(eng, model=str(tmp_path))  # version 0: the config's model, a local checkpoint
    stopped_midway(moves, eng, version=1)
    assert moves.broken is None and eng.checkpoints == [str(tmp_path)]
    assert eng.weights["w0"][0] == -1.0 and moves.weights_version == 0


def test_a_replica_with_nothing_to_reload_from_restarts():
    eng = MixingEngine()
    moves = moves_with(eng)  # dummy weights: nowhere to load them from again
    stopped_midway(moves, eng, version=1)
    assert isinstance(moves.broken, WeightsLoadBroken) and eng.checkpoints == []


def test_a_stop_before_the_engine_was_touched_leaves_it_as_it_was_and_drops_a_note():
    eng = MixingEngine()
    moves = moves_with(eng)
    objects, _ = pushed(2.0)
    moves.apply(NoteWeights(OTHER, 3, objects[:1]))  # asleep: noted, nothing loaded
    assert moves.noted == (3, OTHER)
    moves.apply(StopPush(OTHER, "x"))
    assert moves.noted == (0, "") and moves.noted_buckets is None

    async def go():
        moves.apply(LoadWeights(OTHER, 4, objects[:1]))  # the manifest alone
        moves.apply(StopPush(OTHER, "x"))
        await asyncio.wait_for(moves.loading[1], 5)

    asyncio.run(go())
    assert moves.broken is None and eng.weights == {} and "stopped after 1 of its" in moves.weights_error


def test_a_stopped_stream_fails_its_reader_at_once_naming_why():
    objects, _ = pushed(2.0)

    async def go():
        stream = BucketStream(OTHER, objects[:2])
        waiting = asyncio.ensure_future(stream.ref(2))
        await asyncio.sleep(0.05)
        stream.stop("the trainer's push failed: OSError: disk")
        with pytest.raises(BucketsStopped, match="stopped after 2 of its .* OSError: disk"):
            await asyncio.wait_for(waiting, 1)
        with pytest.raises(BucketsStopped):  # even an object that came: the load cannot complete
            await stream.ref(0)

    asyncio.run(go())


# ---- the trainer ----------------------------------------------------------------------------------
class FakeRef:
    def __init__(self, i):
        self.i = i

    def hex(self):
        return f"{self.i:032x}"


class Answer:
    def __init__(self, value):
        self.value = value

    def result(self, timeout_s=None):
        return self.value


class AbortRouter:
    """A router that logs the push's signed orders."""

    def __init__(self, log):
        router = self

        class Method:
            def __init__(self, name):
                self.name = name

            def remote(self, order, refs=()):
                log.append((self.name, dict(order.args)))
                return Answer({"push_weights": 7, "push_abort": {"aborted": 7, "version": 6}}.get(self.name))

        router.push_weights, router.push_more, router.push_abort = (Method(n) for n in
                                                                    ("push_weights", "push_more", "push_abort"))


def test_a_trainer_that_fails_mid_stream_aborts_the_push_and_raises_its_own_error(monkeypatch):
    import ray

    from router_support import SIGNER

    puts = []
    monkeypatch.setattr(ray, "put", lambda obj: puts.append(obj) or FakeRef(len(puts) - 1))
    real_put = push_mod._put

    def failing_put(group, i, stage, bucket_bytes):
        if i >= 3:
            raise MemoryError("pinned memory exhausted")
        return real_put(group, i, stage, bucket_bytes)

    monkeypatch.setattr(push_mod, "_put", failing_put)
    monkeypatch.setenv(push_mod.STREAM_ENV, "1")
    log = []
    named = [(f"w{i}", torch.full((4,), float(i))) for i in range(7)]
    with pytest.raises(MemoryError, match="pinned memory exhausted"):
        push_mod.push(AbortRouter(log), SIGNER, named, None, 16, 5.0)
    assert [what for what, _ in log] == ["push_weights", "push_more", "push_abort"]
    order, abort = log[0][1], log[-1][1]
    assert order["objects"] == 8 and len(order["buckets"]) == 2  # the manifest and 7 buckets, 2 sent
    assert abort == {"source": order["source"],
                     "reason": "the trainer's push failed: MemoryError: pinned memory exhausted"}


def test_a_push_that_waits_for_every_bucket_names_them_all_and_has_nothing_to_abort(monkeypatch):
    import ray

    from router_support import SIGNER

    puts = []
    monkeypatch.setattr(ray, "put", lambda obj: puts.append(obj) or FakeRef(len(puts) - 1))
    monkeypatch.delenv(push_mod.STREAM_ENV, raising=False)
    log = []
    push_mod.push(AbortRouter(log), SIGNER, [(f"w{i}", torch.zeros(4)) for i in range(3)], None, 16, 5.0)
    assert [what for what, _ in log] == ["push_weights"] and log[0][1]["objects"] == 4 == len(log[0][1]["buckets"])
