"""A streamed push whose later order was lost with its pull's reply (the replica's pull timed out,
or the RPC failed): the replica loads the push (its first order came) knowing fewer objects than
the router's last order named. It reports how many it knows (WeightsState.objects), and the
router sends the order again naming them all, instead of the load failing when the stream stalls
(60 s). A replica that knows them all is not ordered again."""
import asyncio

from rollout_cluster.protocol import LoadWeights, NoteWeights, Report, SleepState, WeightsState
from rollout_cluster.protocol.reports import EngineStats

from test_fleet_sleep import core_with, pull
from test_push_stream import SRC, TensorEngine, loads, moves_of, noted_sleeper, pushed


def report(core, rid, now, objects, loading=1, noted=(0, ""), level=0):
    """A replica's pull, loading (or noted) the push and knowing `objects` of its objects."""
    w = WeightsState(loading=loading, loading_path=SRC if loading else "", noted=noted[0], noted_path=noted[1],
                     objects=objects)
    return core.on_report(Report(rid, "i1", progress=[], stats=EngineStats(), capacity=8, weights=w,
                                 sleep=SleepState(level=level, goal=level)), now)


def pushing():
    """Replica a loads the push (manifest, b0); b1 came, and a's order naming it went out."""
    core = core_with(("a",))
    core.update_weights(SRC, None, ("m", "b0"))
    assert loads(pull(core, "a", 1.0)) == [LoadWeights(SRC, 1, ("m", "b0"))]
    core.control.push_more(SRC, 2, ("b1",))
    assert loads(report(core, "a", 1.1, objects=2)) == [LoadWeights(SRC, 1, ("m", "b0", "b1"))]
    return core


def test_a_lost_push_more_order_is_sent_again_after_the_replica_reports_fewer_objects():
    """Regression: the reply carrying the order naming b1 was lost; the replica loads the push and
    says it knows 2 objects. Before, the router counted b1 as sent and never resent it: the load
    waited for it and failed after 60 s."""
    core = pushing()  # (the reply to that pull never reached a)
    assert loads(report(core, "a", 1.2, objects=2)) == [LoadWeights(SRC, 1, ("m", "b0", "b1"))]
    assert loads(report(core, "a", 1.3, objects=3)) == []  # it came this time


def test_a_replica_that_knows_every_object_is_not_ordered_again():
    core = pushing()
    for t in (1.2, 1.3, 1.4):  # no order storm
        assert loads(report(core, "a", t, objects=3)) == []
    assert loads(report(core, "a", 1.5, objects=0)) == []  # a replica that does not say: as before


def test_a_report_made_before_the_waiting_order_was_pulled_sends_it_once():
    """The report that pulls the order (waiting in the outbox since push_more) still names the
    objects before it: the order goes once, with this reply, not a second time."""
    core = core_with(("a",))
    core.update_weights(SRC, None, ("m", "b0"))
    pull(core, "a", 1.0)
    core.control.push_more(SRC, 2, ("b1",))
    core.control.push_more(SRC, 3, ("b2",))
    assert loads(report(core, "a", 1.1, objects=2)) == [LoadWeights(SRC, 1, ("m", "b0", "b1", "b2"))]
    assert loads(report(core, "a", 1.2, objects=4)) == []


def test_a_lost_note_of_later_objects_is_sent_again_to_a_sleeper():
    core = noted_sleeper()
    noted = dict(loading=0, noted=(1, SRC), level=1)
    assert loads(report(core, "a", 1.1, objects=2, **noted)) == [NoteWeights(SRC, 1, ("m", "b0", "b1"))]  # lost
    assert loads(report(core, "a", 1.2, objects=2, **noted)) == [NoteWeights(SRC, 1, ("m", "b0", "b1"))]
    assert loads(report(core, "a", 1.3, objects=3, **noted)) == []


def test_engine_moves_reports_how_many_objects_of_the_push_it_knows():
    objects, _ = pushed(3)
    moves = moves_of(TensorEngine())

    async def go():
        assert moves.states()[0].objects == 0  # no push
        moves.apply(LoadWeights(SRC, 1, objects[:2]))
        assert moves.states()[0].objects == 2
        moves.apply(LoadWeights(SRC, 1, objects[:3]))
        assert moves.states()[0].objects == 3
        moves.apply(LoadWeights(SRC, 1, objects))
        await asyncio.wait_for(moves.loading[1], 5)

    asyncio.run(go())
    assert moves.weights_version == 1 and moves.states()[0].objects == 0  # loaded: none under way


def test_a_noted_push_reports_its_objects():
    objects, _ = pushed(2)
    moves = moves_of(TensorEngine())
    moves.apply(NoteWeights(SRC, 1, objects[:2]))
    assert moves.states()[0].objects == 2
    moves.apply(NoteWeights(SRC, 1, objects))
    assert moves.states()[0].objects == 3
