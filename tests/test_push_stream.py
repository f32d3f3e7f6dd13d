"""A push streamed (transfer/push.py, transfer/bucket_stream.py): the trainer's order goes out with
the manifest and the first bucket, the later buckets follow with `push_more` while the replicas
already load. The router hands each replica ordered (or noted) the push its order again, naming
the new buckets, and a joiner the whole push; a replica adds them to the load under way; a push
whose objects stop coming (the trainer died, its router restarted) fails the load naming what
came, instead of hanging. The real path: tests/e2e/test_push_weights.py (every push streams)."""
import asyncio

from typing import Optional

import pytest
import torch

from rollout_cluster.config import ClusterConfig, EngineConfig
from rollout_cluster.engines.base import WeightsLoadBroken
from rollout_cluster.protocol import InputError, LoadWeights, ModelInfo, NoteWeights, Report, WeightsState
from rollout_cluster.serve.engine_moves import EngineMoves, fetched
from rollout_cluster.transfer import bucket_stream, push as push_mod
from rollout_cluster.transfer.bucket_stream import BucketStream
from rollout_cluster.transfer.buckets import header, is_manifest, manifest, pack
from rollout_cluster.transfer.push import PUSH_SCHEME

from test_fleet_sleep import core_with, pull

SRC = f"{PUSH_SCHEME}s1"


def loads(orders):
    return [c for c in orders.control if isinstance(c, (LoadWeights, NoteWeights))]


def test_later_buckets_reach_the_replicas_ordered_before_them_and_a_joiner_gets_the_whole_push():
    core = core_with(("a", "b"))
    core.update_weights(SRC, None, ("m", "b0"))
    assert loads(pull(core, "a", 1.0)) == [LoadWeights(SRC, 1, ("m", "b0"))]  # a starts on what came
    assert core.control.push_more(SRC, 2, ("b1",)) == 3
    assert core.control.push_more(SRC, 3, ("b2",)) == 4
    assert loads(pull(core, "a", 1.1, loading=1)) == [LoadWeights(SRC, 1, ("m", "b0", "b1", "b2"))]
    # b had not pulled: one order, naming every bucket (the one waiting was replaced in place)
    assert loads(pull(core, "b", 1.2)) == [LoadWeights(SRC, 1, ("m", "b0", "b1", "b2"))]
    assert loads(pull(core, "a", 1.3, loading=1)) == []  # nothing new: no order again
    assert loads(pull(core, "c", 1.4, model=ModelInfo(100, 64))) == [LoadWeights(SRC, 1, ("m", "b0", "b1", "b2"))]
    pull(core, "a", 1.5, version=1, path=SRC)
    assert core.control.push_more(SRC, 4, ("b3",)) == 5  # (a trainer that sends more than its manifest: the replica refuses)
    assert loads(pull(core, "a", 1.6, version=1, path=SRC)) == []  # it holds the version: nothing to add


def noted_sleeper():
    """Replica a asleep, noted the push (manifest, b0); then b1 came (push_more)."""
    core = core_with(("a",))
    core.sleep_fleet(1)
    pull(core, "a", 0.5)
    pull(core, "a", 0.6, level=1)
    core.update_weights(SRC, None, ("m", "b0"))
    assert loads(pull(core, "a", 1.0, level=1)) == [NoteWeights(SRC, 1, ("m", "b0"))]
    core.control.push_more(SRC, 2, ("b1",))
    return core


def test_a_replica_asleep_gets_its_note_again_with_the_later_buckets():
    core = noted_sleeper()
    assert loads(pull(core, "a", 1.1, level=1, noted=(1, SRC))) == [NoteWeights(SRC, 1, ("m", "b0", "b1"))]


def test_a_replica_whose_load_failed_is_not_ordered_the_push_again():
    core = core_with(("a",))
    core.update_weights(SRC, None, ("m", "b0"))
    pull(core, "a", 1.0)
    failed = WeightsState(version=0, error="replica a: bucket 0 refused", error_version=1, error_path=SRC)
    core.on_report(Report("a", "i1", progress=[], capacity=8, weights=failed), 1.1)
    core.control.push_more(SRC, 2, ("b1",))
    assert loads(pull(core, "a", 1.2)) == [] and "a" in core.weights.errors


def test_push_more_names_the_field_it_refuses():
    core = core_with(("a",))
    with pytest.raises(InputError, match="source"):  # no push at all
        core.control.push_more(SRC, 1, ("b1",))
    core.update_weights(SRC, None, ("m", "b0"))
    with pytest.raises(InputError, match=r"start.*must be 2"):
        core.control.push_more(SRC, 3, ("b1",))
    with pytest.raises(InputError, match="source"):
        core.control.push_more(f"{PUSH_SCHEME}other", 2, ("b1",))
    pull(core, "a", 1.0)
    pull(core, "a", 1.1, version=1, path=SRC)
    core.update_weights("/ckpt/2")
    with pytest.raises(InputError, match="push the weights again"):  # replaced by a newer version
        core.control.push_more(SRC, 2, ("b1",))


def pushed(n_buckets: int = 3) -> tuple:
    """(the push's objects as dicts: its manifest, then each bucket; the names in order)."""
    g = torch.Generator().manual_seed(0)
    named = [(f"w{i}", torch.randn(8, generator=g)) for i in range(n_buckets)]
    buckets = list(pack(named, bucket_bytes=32))  # one tensor a bucket
    return (manifest([header(b) for b in buckets]), *buckets), [n for n, _ in named]


class TensorEngine:
    """A replica's engine that records what it loads (the manifest is checked, not loaded)."""

    def __init__(self):
        self.loaded: list = []
        self.took = asyncio.Event()

    async def load_tensors(self, buckets, keep_as=None):
        async for bucket in buckets:
            if not is_manifest(bucket):
                self.loaded += [n for n, _ in bucket]
                self.took.set()
        return len(self.loaded)


def moves_of(eng):
    return EngineMoves(eng, ClusterConfig(engine=EngineConfig(model="models/none")), "a")


def test_a_load_started_before_the_later_buckets_came_loads_them_when_its_order_comes_again():
    objects, names = pushed(3)
    eng = TensorEngine()
    moves = moves_of(eng)

    async def go():
        moves.apply(LoadWeights(SRC, 1, objects[:2]))  # the order: manifest and bucket 0
        await asyncio.wait_for(eng.took.wait(), 5)
        assert eng.loaded == names[:1] and not moves.loading[1].done()  # it waits for bucket 1
        moves.apply(LoadWeights(SRC, 1, objects[:3]))  # the router's order again, naming bucket 1
        moves.apply(LoadWeights(SRC, 1, objects))
        await asyncio.wait_for(moves.loading[1], 5)

    asyncio.run(go())
    assert eng.loaded == names and (moves.weights_version, moves.weights_error) == (1, None)


def test_a_push_whose_objects_stop_coming_fails_the_load_naming_what_came(monkeypatch):
    """Regression for the stream's end: a trainer that dies mid-push sends no more push_more;
    the replica waiting for the next bucket must fail, not wait for ever."""
    monkeypatch.setattr(bucket_stream, "STALL_S", 0.3)
    objects, names = pushed(3)
    eng = TensorEngine()
    moves = moves_of(eng)

    async def go():
        moves.apply(LoadWeights(SRC, 1, objects[:2]))
        await asyncio.wait_for(moves.loading[1], 5)  # not a hang

    asyncio.run(go())
    assert eng.loaded == names[:1] and moves.weights_version == 0
    assert "2 of its 4 objects came, then none for 0 s" in moves.weights_error
    assert "push the weights again" in moves.weights_error


def test_in_the_engine_a_stopped_push_breaks_the_load_it_began_with_why(monkeypatch):
    """The real replica loader (weight_loader.load_into, TensorLoader in this process): the first
    bucket went in, so the weights are a mix, and the error says why the rest did not come."""
    from rollout_cluster.engines.weight_loader import load_into
    from test_shm_slots import Engine

    pytest.importorskip("vllm.config")  # (the stand-in engine imports it: seconds, not inside the timed load)
    monkeypatch.setattr(bucket_stream, "STALL_S", 0.3)
    objects, names = pushed(2)
    stream = BucketStream(SRC, objects[:2])
    eng = Engine()
    with pytest.raises(WeightsLoadBroken, match=r"a mix of old and new: BucketsStopped: .*2 of its 3 objects came"):
        asyncio.run(asyncio.wait_for(load_into(eng, fetched(stream), None), 30))
    assert list(eng.worker.rec.got) == names[:1]


def test_a_stream_refuses_more_objects_than_its_manifest_names():
    objects, _ = pushed(1)

    async def go():
        return [b async for b in fetched(BucketStream(SRC, (*objects, objects[1])))]

    with pytest.raises(ValueError, match="3 objects named, its manifest has 1 buckets"):
        asyncio.run(go())


class FakeRef:
    def __init__(self, i):
        self.i = i

    def hex(self):
        return f"{self.i:032x}"


class Answer:
    def __init__(self, log, what, value):
        self.log, self.what, self.value = log, what, value

    def result(self, timeout_s=None):
        self.log.append(("answered", self.what))
        return self.value


class FakeRouter:
    def __init__(self, log, leased: bool = False):
        outer = self
        self.leased = leased  # the push's order must come with the trainer's lease ("lease")

        class Method:
            def __init__(self, name):
                self.name = name

            def remote(self, order, refs, *lease):
                assert lease == (("lease",) if self.name == "push_weights" and outer.leased else ())
                log.append((self.name, order.args.get("start"), [r.i for r in refs]))
                assert order.args["buckets"] == [r.hex() for r in refs]
                return Answer(log, self.name, 7 if self.name == "push_weights" else None)

        outer.push_weights, outer.push_more = Method("push_weights"), Method("push_more")


def _logged_push(monkeypatch, stream: Optional[bool], put_s: float = 0.0, arg: Optional[bool] = None) -> tuple:
    """push() of seven 16-byte tensors in 16-byte buckets with ray.put and the router logged:
    (the log, what was put, push's refs). `put_s`: each put takes that long on push's clock.
    `stream`: ROLLOUT_PUSH_STREAM "1" or "0", None: unset (the default). `arg`: push's `stream`."""
    import ray

    from router_support import SIGNER

    log, puts, clock = [], [], [0.0]
    monkeypatch.setattr(push_mod, "monotonic", lambda: clock[0])

    def put(obj):
        puts.append(obj)
        log.append(("put", len(puts) - 1))
        clock[0] += put_s
        return FakeRef(len(puts) - 1)

    monkeypatch.setattr(ray, "put", put)
    if stream is None:
        monkeypatch.delenv(push_mod.STREAM_ENV, raising=False)
    else:
        monkeypatch.setenv(push_mod.STREAM_ENV, "1" if stream else "0")
    named = [(f"w{i}", torch.full((4,), float(i))) for i in range(7)]
    leases = []
    streamed = arg if arg is not None else stream is not False
    v, source, refs = push_mod.push(FakeRouter(log, leased=streamed), SIGNER, named, None, 16, 5.0,
                                    lease=lambda: leases.append(1) or "lease", stream=arg)
    assert len(leases) == (1 if streamed else 0)  # (a lease only for a streamed push)
    assert v == 7 and source.startswith(PUSH_SCHEME)
    return log, puts, refs


WHOLE = manifest([{"names": [f"w{i}"], "dtypes": ["float32"], "shapes": [[4]]} for i in range(7)])


def test_the_trainer_sends_the_order_with_the_manifest_and_first_bucket_then_the_rest_doubling(monkeypatch):
    """Streamed: the order names the manifest and bucket 0; each push_more as many buckets as were
    sent before (1, 2, 4, ...) and the rest at the end: the router's orders again name about twice
    the push's objects per replica, not one order per bucket, each naming every object so far."""
    log, puts, refs = _logged_push(monkeypatch, stream=True)
    assert [r.i for r in refs] == list(range(8)) and puts[0] == WHOLE
    assert log == [("put", 0), ("put", 1), ("push_weights", None, [0, 1]), ("answered", "push_weights"),
                   ("put", 2), ("push_more", 2, [2]),
                   ("put", 3), ("put", 4), ("answered", "push_more"), ("push_more", 3, [3, 4]),
                   ("put", 5), ("put", 6), ("put", 7), ("answered", "push_more"), ("push_more", 5, [5, 6, 7]),
                   ("answered", "push_more")]  # (the last: the rest, fewer than doubling would wait for)


def test_a_slow_trainer_sends_its_later_buckets_at_least_every_ten_seconds(monkeypatch):
    """Regression: doubling alone held the last batch (half a push) until every bucket of it was
    put; a trainer putting a large model's half for over 60 s left the replicas without a new
    object that long, and their loads failed as a stopped push. Each put takes 6 s here: the
    push_more of buckets 5 and 6 goes when 10 s passed, not with bucket 7 (doubling would wait)."""
    log, puts, refs = _logged_push(monkeypatch, stream=True, put_s=6.0)
    assert [r.i for r in refs] == list(range(8))
    assert [(start, named) for what, start, named in (e for e in log if len(e) == 3)] == [
        (None, [0, 1]), (2, [2]), (3, [3, 4]), (5, [5, 6]), (7, [7])]


def test_streaming_is_the_default_and_its_order_comes_with_the_trainers_lease(monkeypatch):
    """Unset, ROLLOUT_PUSH_STREAM streams: the order goes with the first bucket, and with the
    trainer's lease (which the router watches until the last bucket comes: serve/push_watch.py)."""
    log, puts, refs = _logged_push(monkeypatch, stream=None)
    assert [e[0] for e in log if len(e) == 3] == ["push_weights", "push_more", "push_more", "push_more"]
    assert log[:3] == [("put", 0), ("put", 1), ("push_weights", None, [0, 1])]


def test_unstreamed_the_order_waits_for_every_bucket_and_no_push_more_follows(monkeypatch):
    """ROLLOUT_PUSH_STREAM=0: a trainer that fails while putting its buckets fails before any
    replica is ordered, so no engine is left half loaded; the order names the manifest first,
    then the buckets, and comes without a lease (there is nothing to wait for)."""
    log, puts, refs = _logged_push(monkeypatch, stream=False)
    assert puts[refs[0].i] == WHOLE and [r.i for r in refs[1:]] == list(range(7))
    assert log == [("put", i) for i in range(8)] + [("push_weights", None, [7] + list(range(7))),
                                                    ("answered", "push_weights")]


def test_the_callers_stream_argument_overrides_the_environment(monkeypatch):
    """push_weights(stream=False) for a generator that gathers shards as it goes (a streamed push
    holds every tensor until packed); stream=True streams where ROLLOUT_PUSH_STREAM=0."""
    log, _, _ = _logged_push(monkeypatch, stream=None, arg=False)
    assert [e[0] for e in log if len(e) == 3] == ["push_weights"]  # every bucket before the one order
    log, _, _ = _logged_push(monkeypatch, stream=False, arg=True)
    assert [e[0] for e in log if len(e) == 3][:2] == ["push_weights", "push_more"]


@pytest.mark.parametrize("bad", ["yes", 1, 0, "0"])
def test_a_stream_that_is_no_bool_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=r"stream=.*must be True, False or None"):
        push_mod.check_stream(bad)
