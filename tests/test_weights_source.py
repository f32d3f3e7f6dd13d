"""A weights version's number alone does not say a replica holds the router's weights: its source
(a checkpoint's path, a push's "push://<id>") must be the router's too.

Regression (h-route9, item 2): a replica cut off from a restarted router for longer than
router.replica_timeout_s keeps its old weights; the new router, no longer waiting for it, could
number a later order with the number the replica holds. The router then took the replica for
current (by number) and gave it work on other weights, and the replica itself took the new order
for a resent one (same number) and never loaded it. Both now compare the source too
(router/weights.py FleetWeights.holds, serve/engine_moves.py)."""
import asyncio

from rollout_cluster.config import ClusterConfig, EngineConfig, PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import (EngineStats, LoadWeights, ModelInfo, Report, SamplingSpec, SequenceRequest,
                                      WeightsState)
from rollout_cluster.router.core import RouterCore
from rollout_cluster.serve.engine_moves import EngineMoves

COST = load_profile("h200-1.5b", max_num_seqs=8)
TIMEOUT_S = 60.0


def pull(core: RouterCore, rid: str, now: float, version: int = 0, path: str = ""):
    return core.on_report(Report(rid, "i1", stats=EngineStats(), model=ModelInfo(1000, 4096), capacity=8,
                                 weights=WeightsState(version=version, path=path)), now)


def renumbered(old: str, new: str) -> RouterCore:
    """A restarted router expecting a and b: b stays cut off past the replica timeout, holding
    version 3 from `old`; the router then numbers `new` as version 3 too, which a loads."""
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=2,
                      replica_timeout_s=TIMEOUT_S)
    pull(core, "a", 0.0)
    assert core.update_weights(new, 3, now=TIMEOUT_S + 1) == 3  # b was not heard: its 3 is unknown
    pull(core, "a", TIMEOUT_S + 2, version=3, path=new)
    return core


def test_a_replica_holding_a_renumbered_version_from_other_weights_is_not_current():
    for old, new in (("/ckpt/old-3", "/ckpt/new-3"), ("push://p-old", "push://p-new")):
        core = renumbered(old, new)
        orders = pull(core, "b", TIMEOUT_S + 3, version=3, path=old)  # b comes back
        b = core.fleet.replicas["b"]
        assert not core.usable(b), old  # no work on other weights
        assert [c for c in orders.control if isinstance(c, LoadWeights)] == [LoadWeights(new, 3)]
        core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=2), 0, 0)], TIMEOUT_S + 4)
        assert not pull(core, "b", TIMEOUT_S + 5, version=3, path=old).start  # still the old weights
        pull(core, "b", TIMEOUT_S + 6, version=3, path=new)  # loaded
        assert core.usable(b) and not core.weights.errors


def test_a_replica_loads_an_order_that_reuses_its_versions_number_for_other_weights():
    class Engine:
        loaded: list = []

        async def load_weights(self, path, keep_as=None):
            self.loaded.append(path)

    eng = Engine()
    moves = EngineMoves(eng, ClusterConfig(engine=EngineConfig(model="models/none")), "b")

    async def go():
        moves.apply(LoadWeights("/ckpt/old-3", 3))
        await moves.loading[1]
        moves.apply(LoadWeights("/ckpt/old-3", 3))  # a resent order: nothing to do
        assert moves.loading is None
        moves.apply(LoadWeights("/ckpt/new-3", 3))  # a restarted router's, reusing the number
        assert moves.loading is not None
        await moves.loading[1]

    asyncio.run(go())
    assert eng.loaded == ["/ckpt/old-3", "/ckpt/new-3"]
    assert (moves.weights_version, moves.weights_path) == (3, "/ckpt/new-3")


def test_a_sleeping_replica_keeps_a_note_that_reuses_its_versions_number_for_other_weights():
    from rollout_cluster.protocol import NoteWeights

    moves = EngineMoves(object(), ClusterConfig(engine=EngineConfig(model="models/none")), "b")
    moves.weights_version, moves.weights_path = 3, "/ckpt/old-3"
    moves.apply(NoteWeights("/ckpt/old-3", 3))  # what it holds: nothing to note
    assert moves.noted == (0, "")
    moves.apply(NoteWeights("/ckpt/new-3", 3))
    assert moves.states()[0].noted == 3 and moves.states()[0].noted_path == "/ckpt/new-3"


def test_a_cut_off_replicas_failed_load_of_a_renumbered_version_does_not_break_the_routers_weights():
    # Regression (h-rev9): the router took a load error by its version number alone. b, cut off,
    # had failed loading the OLD router's version 3; its stale error marked the new router's
    # version 3 (another checkpoint, which a loaded) broken: b was held back from it for good.
    core = renumbered("/ckpt/old-3", "/ckpt/new-3")
    orders = core.on_report(Report("b", "i1", stats=EngineStats(), model=ModelInfo(1000, 4096), capacity=8,
                                   weights=WeightsState(version=2, path="/ckpt/2", error="b: load failed",
                                                        error_version=3, error_path="/ckpt/old-3")),
                            TIMEOUT_S + 3)
    assert not core.weights.broken and "b" not in core.weights.errors
    assert [c for c in orders.control if isinstance(c, LoadWeights)] == [LoadWeights("/ckpt/new-3", 3)]


def test_a_replica_reports_the_source_of_the_load_that_failed():
    class Engine:
        async def load_weights(self, path, keep_as=None):
            raise RuntimeError("bad checkpoint")

    moves = EngineMoves(Engine(), ClusterConfig(engine=EngineConfig(model="models/none")), "b")

    async def go():
        moves.apply(LoadWeights("/ckpt/old-3", 3))
        await moves.loading[1]

    asyncio.run(go())
    w = moves.states()[0]
    assert (w.error_version, w.error_path) == (3, "/ckpt/old-3") and "bad checkpoint" in w.error
