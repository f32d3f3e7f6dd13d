"""EngineReplica's goodbye at shutdown, without Ray: work it held must reach the router or be
reported lost (a warning); a goodbye with nothing in it that finds the router gone (the whole
application being deleted) is routine, not a warning."""
import asyncio
import logging
import types

import pytest

from rollout_cluster.config import ClusterConfig
from rollout_cluster.serve.engine_moves import EngineMoves
from rollout_cluster.serve.pull_loop import PullLoop
from rollout_cluster.serve.replica import EngineReplica
from rollout_cluster.protocol import EngineStats, SeqProgress


class Engine:
    capacity = 8

    def __init__(self, finals=()):
        self.finals = list(finals)
        self.shut = False

    def held(self):
        return []

    def drain(self):
        out, self.finals = self.finals, []
        return out

    def stats(self):
        return EngineStats()

    async def shutdown(self):
        self.shut = True


class GoneRouter:
    class pull:  # noqa: N801 (a handle's method)
        @staticmethod
        def remote(report):
            async def fail():
                raise RuntimeError("Deployment 'Router' is unavailable")
            return fail()


class BareReplica(EngineReplica.func_or_class):
    def __del__(self):  # garbage collection: nothing to do (the test calls the real one itself)
        pass


def shut_down(engine) -> None:
    r = object.__new__(BareReplica)
    r.cfg, r.engine, r.router, r.replica_id = ClusterConfig(), engine, GoneRouter(), "r0"
    r.link = types.SimpleNamespace(pull=r.router.pull.remote)  # (serve/router_link.py: the replica's calls)
    r.moves = EngineMoves(engine, r.cfg, "r0")
    r.pull_loop = PullLoop(engine, r.moves, r.router.pull.remote, replica_id="r0", incarnation="i0", model=None,
                           router_cfg=r.cfg.router)

    async def go():
        r.task = asyncio.get_running_loop().create_task(asyncio.sleep(0))  # a pull loop that ended
        await r.task
        await EngineReplica.func_or_class.__del__(r)

    asyncio.run(go())


@pytest.fixture(autouse=True)
def serve_log(caplog):
    """Ray stops its loggers' records at "ray" (no propagation to the root, where caplog listens)."""
    logger = logging.getLogger("ray.serve")
    logger.addHandler(caplog.handler)
    level, logger.level = logger.level, logging.INFO
    yield
    logger.removeHandler(caplog.handler)
    logger.setLevel(level)


def warnings_of(caplog):
    return [rec.getMessage() for rec in caplog.records if rec.levelno >= logging.WARNING]


def test_an_empty_goodbye_to_a_router_that_is_gone_is_not_a_warning(caplog):
    engine = Engine()
    shut_down(engine)
    assert engine.shut and warnings_of(caplog) == []
    assert any("held no work" in m and "is unavailable" in m for m in (rec.getMessage() for rec in caplog.records))


def test_tokens_that_could_not_be_handed_back_are_a_warning(caplog):
    engine = Engine([SeqProgress(3, 0, [5, 6], None, "abort", offset=0)])
    shut_down(engine)
    assert engine.shut and any("could not hand its work back" in w and "is unavailable" in w
                               for w in warnings_of(caplog))
