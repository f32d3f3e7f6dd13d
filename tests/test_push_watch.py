"""The router's watch on a streamed push's trainer (serve/push_watch.py): the push is aborted when
Ray says the trainer's lease died, and only then; a push that came whole, was replaced, or came
without a lease is not watched. The lease here answers as a test says; the real trainer that dies:
tests/e2e/test_push_weights_vllm.py."""
from concurrent.futures import Future

from ray.exceptions import ActorDiedError, ActorUnavailableError

from rollout_cluster.serve.push_watch import PushWatch

from test_push_abort import OTHER, SRC, at_checkpoint_then_streaming


class Lease:
    """An actor handle whose pings the test answers: `answer(None)` alive, `answer(error)` failed."""

    def __init__(self):
        self.pings: list[Future] = []
        lease = self

        class Alive:
            @staticmethod
            def remote():
                class Ref:
                    @staticmethod
                    def future():
                        lease.pings.append(Future())
                        return lease.pings[-1]
                return Ref()

        self.alive = Alive()

    def answer(self, error=None) -> None:
        ping = self.pings[-1]
        ping.set_exception(error) if error is not None else ping.set_result(True)


def died(init_failed: bool = False) -> ActorDiedError:
    e = ActorDiedError()
    e._actor_init_failed = init_failed  # (Ray sets it where the actor's creation failed)
    return e


def test_a_live_trainer_is_pinged_once_a_tick_and_its_push_goes_on():
    core = at_checkpoint_then_streaming()
    watch, lease = PushWatch(core), Lease()
    watch.watch(SRC, lease)
    assert watch.tick() is None and len(lease.pings) == 1  # the first ping goes out
    assert watch.tick() is None and len(lease.pings) == 1  # not answered yet: no second one
    lease.answer()
    assert watch.tick() is None and len(lease.pings) == 2  # answered alive: the next goes out
    assert core.weights_status()["streaming"] and core.weights.version == 2


def test_a_trainer_whose_lease_died_has_its_push_aborted_once():
    core = at_checkpoint_then_streaming()
    watch, lease = PushWatch(core), Lease()
    watch.watch(SRC, lease)
    watch.tick()
    lease.answer(died())
    source, reason = watch.tick()
    assert source == SRC and reason.startswith("the trainer's process died before the push's last objects came")
    assert "ActorDiedError" in reason
    assert core.abort_push(source, reason) == {"aborted": 2, "version": 1}
    assert watch.tick() is None and len(lease.pings) == 1  # forgotten: no more pings


def test_an_unreachable_lease_is_asked_again_not_taken_for_dead():
    core = at_checkpoint_then_streaming()
    watch, lease = PushWatch(core), Lease()
    watch.watch(SRC, lease)
    watch.tick()
    lease.answer(ActorUnavailableError("the node is busy", b"\0" * 16))
    assert watch.tick() is None and len(lease.pings) == 2  # asked again
    lease.answer(died())
    assert watch.tick()[0] == SRC


def test_a_push_that_came_whole_or_was_replaced_is_no_longer_watched():
    core = at_checkpoint_then_streaming()
    watch, lease = PushWatch(core), Lease()
    watch.watch(SRC, lease)
    watch.tick()
    core.control.push_more(SRC, 2, ("b1", "b2"))  # its last objects came: nothing left to abort
    lease.answer(died())
    assert watch.tick() is None and watch.source is None
    # a push another one replaced: the lease of the first says nothing about the second
    core = at_checkpoint_then_streaming()
    watch, lease = PushWatch(core), Lease()
    watch.watch(OTHER, lease)
    assert watch.tick() is None and lease.pings == []


def test_a_lease_that_cannot_be_called_is_pinged_again_next_tick():
    core = at_checkpoint_then_streaming()
    watch = PushWatch(core)

    class Broken:
        class alive:
            @staticmethod
            def remote():
                raise RuntimeError("a handle from another Ray session")

    watch.watch(SRC, Broken())
    assert watch.tick() is None  # the failed ping is made
    assert watch.tick() is None and watch.source == SRC  # it failed, not as a death: tried again
    assert core.weights.version == 2


def test_a_lease_that_never_started_says_nothing_of_the_trainer_and_is_not_taken_for_dead():
    """Its creation failed (a runtime env, a placement): the trainer may well live; the push is no
    longer watched (the replicas' stall limit still ends a push whose trainer died)."""
    core = at_checkpoint_then_streaming()
    watch, lease = PushWatch(core), Lease()
    watch.watch(SRC, lease)
    watch.tick()
    lease.answer(died(init_failed=True))
    assert watch.tick() is None and watch.source is None and len(lease.pings) == 1
    assert core.weights.version == 2 and core.weights_status()["streaming"]
