"""A pull the router never answers (a call to a router killed under it can stay unanswered for
good): the replica's pull loop (serve/pull_loop.py) gives up on it after router.replica_timeout_s
and pulls again, with the same deltas, instead of hanging and never reaching the router Serve
starts next."""
import asyncio

from rollout_cluster.config import ClusterConfig, RouterConfig
from rollout_cluster.serve.engine_moves import EngineMoves
from rollout_cluster.serve.pull_loop import PullLoop
from rollout_cluster.protocol import EngineStats, Orders, SeqProgress

TIMEOUT_S = 0.3


class OneDeltaEngine:
    """Holds one running sequence whose first delta is drained once."""
    capacity, dead, ended = 8, None, 0

    def __init__(self):
        self.pending = [SeqProgress("s", 1, [4, 5], offset=0)]

    def drain(self) -> list:
        out, self.pending = self.pending, []
        return out

    def whole_final(self, p):
        return p

    def forget_finals(self, delivered):
        pass

    def held(self) -> list:
        return [("s", 1)]

    def aborting(self) -> list:
        return []

    def stats(self) -> EngineStats:
        return EngineStats(running=1)


class Call:
    def __init__(self, answer):
        self.answer = answer

    def __await__(self):
        return self.answer().__await__()


class RouterThatHangsOnce:
    def __init__(self, replica):
        self.reports, self.replica = [], replica
        self.pull = self

    def remote(self, report):
        self.reports.append(report)
        first = len(self.reports) == 1

        async def answer():
            if first:
                await asyncio.Event().wait()  # never answered
            self.replica.stop()  # one answered pull is all this test needs
            return Orders()
        return Call(answer)


def test_an_unanswered_pull_is_abandoned_after_the_replica_timeout_and_sent_again():
    cfg = ClusterConfig(router=RouterConfig(replica_timeout_s=TIMEOUT_S, idle_pull_wait_s=0.05,
                                            report_interval_s=0.05))
    engine = OneDeltaEngine()
    r = PullLoop(engine, EngineMoves(engine, cfg, "a"), lambda report: router.pull.remote(report),
                 replica_id="a", incarnation="i1", model=None, router_cfg=cfg.router)
    router = RouterThatHangsOnce(r)

    async def run():
        t0 = asyncio.get_running_loop().time()
        await asyncio.wait_for(r.run(), 5 * TIMEOUT_S)
        return asyncio.get_running_loop().time() - t0

    took = asyncio.run(run())
    assert TIMEOUT_S <= took < 4 * TIMEOUT_S
    first, again = router.reports
    assert [p.token_ids for p in again.progress] == [[4, 5]] == [p.token_ids for p in first.progress]
    assert again.progress[0].offset == 0  # the same delta: the router drops it if the first did arrive
    assert again.model is None or again.model == first.model
