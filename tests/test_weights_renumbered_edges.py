"""Two edges of a weights number a restarted router reuses (tests/test_weights_source.py has the
rest): a replica cut off from that router for longer than router.replica_timeout_s may hold, load
or note the OLD router's version N (or a higher one), while the new router numbers other weights N.

1. Regression (h-edge): a sleeping replica dropped the new router's note when its number was below
   the one it held or noted (serve/engine_moves.py compared numbers only). The router sent the
   note again at every pull, and a router restarted during the sleep learned the old weights (a
   pushed version's buckets, kept only with the note, were lost with it). A note is the router's
   latest word: kept whatever its number; a restarted router learns a replica's note before what
   it holds (router/weights.py FleetWeights.learn).
2. Regression (h-edge): a replica that died while loading the OLD router's version N counted
   toward the new router's DEATHS_TO_BREAK for its version N (FleetWeights.died_loading took the
   number it loaded alone): one more death of a replica really loading N broke it. A report now
   names the source of the load (WeightsState.loading_path), and only a death loading the
   router's version (or ordered it, with no load reported yet) counts. The same report's source
   also keeps such a replica from being ordered a version that broke meanwhile, and has a lost
   order sent again (FleetWeights.holds_back, .record)."""
import asyncio

from rollout_cluster.config import ClusterConfig, EngineConfig, PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import (EngineStats, LoadWeights, ModelInfo, NoteWeights, Report, SleepState,
                                      WeightsState)
from rollout_cluster.router.core import RouterCore
from rollout_cluster.serve.engine_moves import EngineMoves

COST = load_profile("h200-1.5b", max_num_seqs=8)
TIMEOUT_S = 60.0
OLD, NEW = "/ckpt/old-7", "/ckpt/new-5"


def router(expected: int = 2) -> RouterCore:
    return RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=expected,
                      replica_timeout_s=TIMEOUT_S)


def report(core: RouterCore, rid: str, now: float, weights: WeightsState, level: int = 0, incarnation="i1",
           dead: bool = False):
    return core.on_report(Report(rid, incarnation, stats=EngineStats(), model=ModelInfo(1000, 4096), capacity=8,
                                 weights=weights, sleep=SleepState(level=level, goal=level),
                                 leaving=dead, engine_dead=dead), now)


def notes(orders) -> list:
    return [c for c in orders.control if isinstance(c, NoteWeights)]


# ---- 1. a sleeping cut-off replica and the new router's note ---------------------------------------
def test_a_sleeping_replica_keeps_a_note_numbered_below_the_version_it_holds():
    moves = EngineMoves(object(), ClusterConfig(engine=EngineConfig(model="models/none")), "b")
    moves.weights_version, moves.weights_path = 7, OLD  # the old router's version 7
    moves.apply(NoteWeights(NEW, 5))  # the new router's version 5: other weights
    w = moves.states()[0]
    assert (w.noted, w.noted_path) == (5, NEW)
    moves.apply(NoteWeights("/ckpt/new-6", 6, buckets=("b6",)))  # its next update replaces it
    assert moves.noted == (6, "/ckpt/new-6") and tuple(moves.kept_buckets("/ckpt/new-6").refs) == ("b6",)
    moves.apply(NoteWeights("/ckpt/new-6", 6))  # a resent note: nothing changes
    assert tuple(moves.noted_buckets.refs) == ("b6",)


def test_the_router_notes_a_cut_off_sleeper_once_and_a_later_router_learns_the_note():
    """b, asleep and cut off, holds the old router's version 7; the new router numbered its own
    checkpoint 5 without hearing b. Wired to b's real EngineMoves: b keeps the note (the router
    sends it once, not at every pull), and a router restarted during the sleep learns version 5
    from b's note, not the old 7 it holds."""
    core = router()
    report(core, "a", 0.0, WeightsState(), level=1)
    core.sleep.set(1)
    assert core.update_weights(NEW, 5, now=TIMEOUT_S + 1) == 5  # b unheard: its 7 is unknown
    moves = EngineMoves(object(), ClusterConfig(engine=EngineConfig(model="models/none")), "b")
    moves.weights_version, moves.weights_path, moves.sleep_level, moves.sleep_goal = 7, OLD, 1, 1
    sent = []
    for i in range(4):  # b comes back and pulls on
        out = report(core, "b", TIMEOUT_S + 2 + i, moves.states()[0], level=1)
        sent += notes(out)
        for order in notes(out):
            moves.apply(order)
    assert sent == [NoteWeights(NEW, 5)] and moves.noted == (5, NEW)

    restarted = router()  # the router dies; b still sleeps
    report(restarted, "b", 0.0, moves.states()[0], level=1)
    assert (restarted.weights.version, restarted.weights.path) == (5, NEW)
    assert restarted.weights.floor.lowest_next(5) == 8  # (nothing is numbered at or below the 7 b holds)


# ---- 2. a cut-off replica's death during the old router's load -------------------------------------
def test_a_cut_off_replica_dying_in_the_old_routers_load_of_the_same_number_is_no_death_of_the_new_one():
    """a, b, c expected; c stays cut off, loading the old router's version 3 (/ckpt/old-3). The new
    router numbers /ckpt/new-3 as 3, ordered to a and b. c comes back, still loading its old 3,
    and its engine dies; then b's engine dies in the new load. One death of the new version's
    loads, not two: not broken, and b's replacement is ordered it."""
    core = router(expected=3)
    report(core, "a", 0.0, WeightsState())
    report(core, "b", 0.0, WeightsState())
    assert core.update_weights("/ckpt/new-3", 3, now=TIMEOUT_S + 1) == 3
    report(core, "b", TIMEOUT_S + 2, WeightsState(loading=3, loading_path="/ckpt/new-3"))
    old_load = WeightsState(version=2, path="/ckpt/2", loading=3, loading_path="/ckpt/old-3")
    report(core, "c", TIMEOUT_S + 3, old_load)  # back: ordered the new 3, behind its old load
    report(core, "c", TIMEOUT_S + 4, old_load, dead=True)  # dies in the old router's load
    assert core.weights.load_deaths.get(("/ckpt/new-3", 3), []) == []
    report(core, "b", TIMEOUT_S + 5, WeightsState(loading=3, loading_path="/ckpt/new-3"), dead=True)
    assert core.weights.load_deaths == {("/ckpt/new-3", 3): ["b"]} and core.weights_status()["broken"] == []
    again = report(core, "b", TIMEOUT_S + 6, WeightsState(), incarnation="i2")
    assert [c for c in again.control if isinstance(c, LoadWeights)] == [LoadWeights("/ckpt/new-3", 3)]


def test_deaths_in_loads_of_the_routers_version_still_break_it():
    """The same fleet, c loading the new router's 3 this time (its order reached it, or a previous
    router ordered the same checkpoint as 3): two deaths in its loads break it, as before."""
    core = router(expected=3)
    report(core, "a", 0.0, WeightsState())
    report(core, "b", 0.0, WeightsState())
    core.update_weights("/ckpt/new-3", 3, now=TIMEOUT_S + 1)
    new_load = WeightsState(version=2, path="/ckpt/2", loading=3, loading_path="/ckpt/new-3")
    report(core, "c", TIMEOUT_S + 3, new_load)
    report(core, "c", TIMEOUT_S + 3.5, new_load, dead=True)
    report(core, "b", TIMEOUT_S + 3.8, WeightsState())  # its order reached it ...
    report(core, "b", TIMEOUT_S + 4, WeightsState(), dead=True)  # ... and it died before reporting its load
    assert [b["path"] for b in core.weights_status()["broken"]] == ["/ckpt/new-3"]
    assert core.weights.load_deaths == {("/ckpt/new-3", 3): ["c", "b"]}


def test_a_replica_reports_the_source_of_the_load_it_runs():
    class Engine:
        async def load_weights(self, path, keep_as=None):
            await asyncio.sleep(0)

    moves = EngineMoves(Engine(), ClusterConfig(engine=EngineConfig(model="models/none")), "c")

    async def go():
        moves.apply(LoadWeights("/ckpt/old-3", 3))
        w = moves.states()[0]
        assert (w.loading, w.loading_path) == (3, "/ckpt/old-3")
        await moves.loading[1]

    asyncio.run(go())
    w = moves.states()[0]
    assert (w.loading, w.loading_path, w.version, w.path) == (0, "", 3, "/ckpt/old-3")


def test_a_cut_off_replica_loading_the_old_routers_same_number_is_held_back_from_a_broken_version():
    """Regression (h-edge): the same number loading was taken for the router's version's load
    (FleetWeights.holds_back), so a cut-off replica coming back after that version broke was
    ordered the broken load, which could break its engine too."""
    core = router(expected=2)
    report(core, "a", 0.0, WeightsState())
    core.update_weights("/ckpt/new-3", 3, now=TIMEOUT_S + 1)
    report(core, "a", TIMEOUT_S + 2, WeightsState(error="a: load failed", error_version=3, error_path="/ckpt/new-3"))
    assert [b["path"] for b in core.weights_status()["broken"]] == ["/ckpt/new-3"]
    back = report(core, "c", TIMEOUT_S + 3, WeightsState(version=2, path="/ckpt/2", loading=3,
                                                         loading_path="/ckpt/old-3"))
    assert [c for c in back.control if isinstance(c, LoadWeights)] == []
    assert "its load failed on replica a" in core.weights_status()["errors"]["c"]


def test_a_lost_order_to_a_replica_loading_the_old_routers_same_number_is_sent_again():
    """Regression (h-edge): a replica ordered the router's version that reports loading the same
    number (another source's) never got the order (a lost reply): it is sent again, not taken for
    under way until that old load ends."""
    core = router(expected=2)
    report(core, "a", 0.0, WeightsState())
    core.update_weights("/ckpt/new-3", 3, now=TIMEOUT_S + 1)
    old_load = WeightsState(version=2, path="/ckpt/2", loading=3, loading_path="/ckpt/old-3")
    first = report(core, "c", TIMEOUT_S + 2, old_load)  # back: ordered; the reply is lost
    assert [c for c in first.control if isinstance(c, LoadWeights)] == [LoadWeights("/ckpt/new-3", 3)]
    again = report(core, "c", TIMEOUT_S + 3, old_load)
    assert [c for c in again.control if isinstance(c, LoadWeights)] == [LoadWeights("/ckpt/new-3", 3)]
    taken = report(core, "c", TIMEOUT_S + 4, WeightsState(version=2, path="/ckpt/2", loading=3,
                                                          loading_path="/ckpt/new-3"))
    assert [c for c in taken.control if isinstance(c, LoadWeights)] == []  # under way: not again
