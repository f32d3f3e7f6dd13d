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
from rollout_cluster.protocol import (EngineStats, InputError, LoadWeights, ModelInfo, NoteWeights, Report, StopPush,
                                      WeightsState)
from rollout_cluster.serve.engine_moves import EngineMoves
from rollout_cluster.transfer import push as push_mod
from rollout_cluster.transfer.bucket_stream import BucketStream, BucketsStopped
from rollout_cluster.transfer.buckets import header, is_manifest, manifest, pack
from rollout_cluster.transfer.push import PUSH_SCHEME

from test_fleet_sleep import batch, core_with, pull
from test_push_stream import FakeRef

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
                             "back_to": 1, "replicas": {}}
    stop = StopPush(SRC, "the trainer's push failed: OSError: disk")
    assert controls(pull(core, "a", 1.2, version=1, path="/ck/1", loading=2)) == [stop]  # it stops its load
    at_b = pull(core, "b", 1.3, version=1, path="/ck/1")
    assert controls(at_b) == [stop]  # its waiting order is gone
    # b holds version 1 and loads nothing: usable again, the batch runs on it (a still loads)
    assert len(at_b.start) == 2 and core.batches.get(bid).weights_version == 1
    # how a's load of it ended, as a's report says
    core.on_report(Report("a", "i1", progress=[], stats=EngineStats(), capacity=8, weights=WeightsState(
        version=1, path="/ck/1", error="stopped; the replica reloaded version 1 from '/ck/1'", error_version=2,
        error_path=SRC)), 1.6)
    assert core.weights_status()["aborted"]["replicas"] == {"a": "stopped; the replica reloaded version 1 from '/ck/1'"}
    assert controls(pull(core, "c", 1.4, model=ModelInfo(100, 64))) == [LoadWeights("/ck/1", 1, None)]  # a joiner


def test_a_stop_lost_with_a_reply_is_sent_again_until_the_replica_says_it_took_it():
    core = at_checkpoint_then_streaming()
    core.abort_push(SRC, "x")
    stop = StopPush(SRC, "x")
    assert controls(pull(core, "a", 1.2, version=1, path="/ck/1", loading=2)) == [stop]  # (this reply is lost)

    def report(t, stopped):
        return core.on_report(Report("a", "i1", progress=[], stats=EngineStats(), capacity=8, weights=WeightsState(
            version=1, path="/ck/1", loading=2, loading_path=SRC, stopped=stopped)), t)

    assert controls(report(1.3, "")) == [stop]  # it still loads the push, and says it took no stop of it
    assert controls(report(1.4, SRC)) == []  # it took it: its load ends on its own (no answer at once, no spin)


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


def test_a_batch_that_named_the_aborted_version_fails_and_one_that_named_none_runs_on_the_old():
    from rollout_cluster.protocol import SamplingSpec, SequenceRequest

    core = at_checkpoint_then_streaming()
    reqs = [SequenceRequest([1, 2], SamplingSpec(max_tokens=2), i, 0) for i in range(2)]
    named, unnamed = core.submit(reqs, 1.1, weights_version=2), core.submit(reqs, 1.1)
    core.abort_push(SRC, "boom", now=1.2)
    done, _, finished = core.fetch(named, 0)
    assert finished and [c.finish_reason for c in done] == ["error", "error"]
    assert "weights_version=2: the push of that version" in done[0].error and "boom" in done[0].error
    assert core.batches.get(unnamed).weights_version == 1 and not core.fetch(unnamed, 0)[2]


def test_a_streamed_push_no_replica_could_load_is_aborted_by_the_router():
    """Push A (version 2) streams and its trainer hangs, or dies without a lease: each replica's
    load fails once the objects stop coming (each reloads version 1). The router aborts the push
    itself once the last replica's load failed: the fleet is back at version 1 and runs work (a
    batch opened on 2 too), the push's later buckets are refused naming why, the next is 3."""
    core = at_checkpoint_then_streaming()
    pull(core, "b", 1.1, version=1, path="/ck/1")
    bid = batch(core, 1.2)
    assert core.batches.get(bid).weights_version == 2

    def failed(rid, t):
        return core.on_report(Report(rid, "i1", progress=[], stats=EngineStats(), capacity=8, weights=WeightsState(
            version=1, path="/ck/1", error=f"replica {rid}: {SRC}: 2 of its 4 objects came, then none for 60 s",
            error_version=2, error_path=SRC)), t)

    assert not controls(failed("a", 62.0))  # b may still load it: nothing aborted yet
    assert core.weights_status()["streaming"] and core.weights_status()["version"] == 2
    stops = controls(failed("b", 62.1))
    st = core.weights_status()
    assert (st["version"], st["path"], st["streaming"], st["errors"]) == (1, "/ck/1", False, {})
    why = st["aborted"]["reason"]
    assert st["aborted"]["version"] == 2 and why.startswith("every replica's load of it failed")
    assert "replica a: " in why and "replica b: " in why
    assert stops == [StopPush(SRC, why)]
    assert core.batches.get(bid).weights_version == 1 and len(pull(core, "a", 62.2, version=1, path="/ck/1").start)
    with pytest.raises(InputError, match="was aborted .every replica's load of it failed"):
        core.control.push_more(SRC, 2, ("b1",))
    assert core.weights.checked(OTHER, None) == 3  # (2 named the aborted weights)


def test_a_streamed_push_one_replica_failed_to_load_is_not_aborted():
    core = at_checkpoint_then_streaming()
    pull(core, "b", 1.1, version=1, path="/ck/1")
    core.on_report(Report("a", "i1", progress=[], stats=EngineStats(), capacity=8, weights=WeightsState(
        version=1, path="/ck/1", error="replica a: bucket 1 refused", error_version=2, error_path=SRC)), 2.0)
    st = core.weights_status()
    assert (st["version"], st["streaming"], st["aborted"]) == (2, True, None) and list(st["errors"]) == ["a"]
    core.control.push_more(SRC, 2, ("b1", "b2"))  # b loads on: the push completes


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


def test_a_replica_reloads_the_checkpoint_it_held_after_a_stopped_push(tmp_path):
    eng = MixingEngine()
    moves = moves_with(eng)

    async def first():
        moves.apply(LoadWeights(str(tmp_path), 1))
        await moves.loading[1]

    asyncio.run(first())
    stopped_midway(moves, eng)
    assert moves.broken is None and eng.checkpoints == [str(tmp_path)] * 2 and eng.weights["w1"][0] == -1.0
    assert (moves.weights_version, moves.weights_path) == (1, str(tmp_path))


def test_a_deep_sleeper_woken_onto_a_push_that_stops_wakes_on_the_weights_it_held(tmp_path):
    """Level 2 dropped the weights; the wake's reload of the fleet's streamed push stops: the
    replica loads the checkpoint it held, and is awake and whole, not restarted."""
    from rollout_cluster.protocol import Sleep, Wake

    class Sleeper(MixingEngine):
        asleep = False

        async def sleep(self, level):
            self.weights, self.asleep = {}, True  # (level 2: the weights are dropped)

        async def wake(self):
            self.asleep = False

        async def sleeping(self):
            return self.asleep

    for touched in (True, False):
        eng = Sleeper()
        moves = moves_with(eng)
        objects, _ = pushed(2.0)

        async def go():
            moves.apply(LoadWeights(str(tmp_path), 1))
            await moves.loading[1]
            moves.apply(Sleep(2))
            await moves.sleep_task
            eng.took.clear()
            moves.apply(Wake(OTHER, 2, objects[:2] if touched else objects[:1]))
            if touched:
                await asyncio.wait_for(eng.took.wait(), 5)
            else:
                await asyncio.sleep(0.05)
            moves.apply(StopPush(OTHER, "x"))
            await asyncio.wait_for(moves.sleep_task, 5)

        asyncio.run(go())
        assert moves.broken is None and moves.sleep_error is None and moves.sleep_level == 0, touched
        assert eng.checkpoints == [str(tmp_path)] * 2 and eng.weights["w0"][0] == -1.0, touched


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
    assert moves.noted == (0, "") and moves.noted_buckets is None and moves.streams == {}  # (its handles let go)

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
class Answer:
    def __init__(self, value):
        self.value = value

    def result(self, timeout_s=None):
        return self.value


class Lost:
    """An answer lost on its way: the call was taken, its result times out."""

    def result(self, timeout_s=None):
        raise TimeoutError("no answer in time")


class AbortRouter:
    """A router that logs the push's signed orders. `answers`: what each method answers instead
    (an Answer's value, or Lost(); a list: one a call, in order)."""

    def __init__(self, log, **answers):
        router = self
        plain = {"push_weights": 7, "push_abort": {"aborted": 7, "version": 6}}

        class Method:
            def __init__(self, name):
                self.name = name

            def remote(self, order, refs=()):
                log.append((self.name, dict(order.args)))
                answer = answers.get(self.name, plain.get(self.name))
                if isinstance(answer, list):
                    answer = answer.pop(0)
                return answer if isinstance(answer, Lost) else Answer(answer)

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


@pytest.mark.parametrize("fleet_at,stands", [(7, True), (6, False)])
def test_a_push_whose_last_answer_was_lost_stands_where_the_router_holds_it_whole(monkeypatch, fleet_at, stands):
    """The last push_more was taken but its answer lost: the router has nothing to abort (every
    object came) and is at this push's version, so the push stands instead of raising (a trainer
    would push again, as another version). At another version it raises as before."""
    import ray

    from router_support import SIGNER

    puts = []
    monkeypatch.setattr(ray, "put", lambda obj: puts.append(obj) or FakeRef(len(puts) - 1))
    monkeypatch.setenv(push_mod.STREAM_ENV, "1")
    log = []
    router = AbortRouter(log, push_more=[3, Lost()], push_abort={"aborted": None, "version": fleet_at})
    named = [(f"w{i}", torch.full((4,), float(i))) for i in range(4)]  # pushed as 1 + 1 + 2 buckets
    if stands:
        v, _, refs = push_mod.push(router, SIGNER, named, None, 16, 5.0)
        assert v == 7 and len(refs) == 5  # the manifest and 4 buckets
    else:
        with pytest.raises(TimeoutError, match="no answer in time"):
            push_mod.push(router, SIGNER, named, None, 16, 5.0)
    assert [what for what, _ in log] == ["push_weights", "push_more", "push_more", "push_abort"]


def test_a_push_that_waits_for_every_bucket_names_them_all_and_has_nothing_to_abort(monkeypatch):
    import ray

    from router_support import SIGNER

    puts = []
    monkeypatch.setattr(ray, "put", lambda obj: puts.append(obj) or FakeRef(len(puts) - 1))
    monkeypatch.setenv(push_mod.STREAM_ENV, "0")
    log = []
    push_mod.push(AbortRouter(log), SIGNER, [(f"w{i}", torch.zeros(4)) for i in range(3)], None, 16, 5.0)
    assert [what for what, _ in log] == ["push_weights"] and log[0][1]["objects"] == 4 == len(log[0][1]["buckets"])


def test_a_trainer_whose_first_order_got_no_answer_aborts_too(monkeypatch):
    """The order's answer timed out (the router may have taken it): the push is aborted as well,
    and the router answers whether there was anything to abort."""
    import ray

    from router_support import SIGNER

    puts = []
    monkeypatch.setattr(ray, "put", lambda obj: puts.append(obj) or FakeRef(len(puts) - 1))
    monkeypatch.setenv(push_mod.STREAM_ENV, "1")
    log = []
    router = AbortRouter(log)

    class Lost:
        def result(self, timeout_s=None):
            raise TimeoutError("no answer in 5 s")

    sent = router.push_weights.remote
    router.push_weights.remote = lambda order, refs=(): (sent(order, refs), Lost())[1]
    with pytest.raises(TimeoutError):
        push_mod.push(router, SIGNER, [(f"w{i}", torch.zeros(4)) for i in range(3)], None, 16, 5.0)
    assert [what for what, _ in log] == ["push_weights", "push_abort"]
    assert log[1][1]["source"] == log[0][1]["source"] and "TimeoutError" in log[1][1]["reason"]
