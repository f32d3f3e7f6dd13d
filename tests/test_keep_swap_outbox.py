"""running="keep" and work already on its way to a replica: a Work a push policy left in a
replica's outbox (assigned at another replica's pull) when the weights change goes back to the
queue (it never ran), and runs on the new weights once a replica holds them; its Completion says
so. The replica's reply carries only its load, so its pull loop goes on pulling (and reporting
its running sequences) during a long keep load. A replica given work with a load all the same
starts it only after the load, and not at all if the load failed (EngineMoves.ready_for_work)."""
import asyncio


from rollout_cluster.config import ClusterConfig, EngineConfig, PolicyConfig, RouterConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.engines.sim_engine import SimEngine
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import LoadWeights, Orders, SamplingSpec, SequenceRequest, Work
from rollout_cluster.router.core import RouterCore
from rollout_cluster.serve.engine_moves import EngineMoves
from rollout_cluster.serve.pull_loop import PullLoop

COST = load_profile("h200-1.5b", max_num_seqs=8)
CFG = ClusterConfig(engine=EngineConfig(kind="sim", model="sim"))


class HeldLoadSimEngine(SimEngine):
    """A replica whose keep load lasts until the test lets it end (`release`)."""

    async def load_weights(self, path: str, keep_as=None) -> None:
        self.release = asyncio.Event()
        await self.release.wait()
        await super().load_weights(path, keep_as)


def run_keep_update_with_work_waiting_for_b(engines: dict, during_b_load=None):
    """Two replicas on version 0; a batch that least-loaded splits at a's pull (b's share waits in
    b's outbox); update_weights(running="keep"); both replicas pull until the batch is done.
    `during_b_load(loops, core)`: awaited once b took its load order. Returns (the completions,
    the orders b took with its load, the batch indices of b's share)."""
    core = RouterCore(make_policy(PolicyConfig(name="least-loaded"), COST), expected_replicas=2)
    clock = {"t": 0.0}

    def now():
        return clock["t"]

    async def go():
        loops, taken = {}, {}
        for rid in ("a", "b"):
            eng = engines.get(rid, SimEngine)(COST, time_scale=1e-4)
            info = await eng.start()

            async def pull(report, rid=rid):
                orders = core.on_report(report, now())
                taken.setdefault(rid, []).append(orders)
                return orders

            loops[rid] = PullLoop(eng, EngineMoves(eng, CFG, rid), pull, replica_id=rid, incarnation="i1",
                                  model=info, router_cfg=RouterConfig(report_interval_s=0.01), clock=now)
        for rid in ("a", "b"):
            await loops[rid].step()  # both join on version 0
        bid = core.submit([SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=6), i, 0) for i in range(4)], now())
        clock["t"] += 0.01
        await loops["a"].step()  # least-loaded assigns to both: b's share waits in b's outbox
        share = sorted(core.seqs[w.seq_id].index for w in core.outbox.get("b").start)
        assert share
        assert core.update_weights("/ckpt/1", running="keep") == 1
        clock["t"] += 0.01
        await asyncio.wait_for(loops["b"].step(), 5.0)
        b_orders = taken["b"][-1]
        assert [c for c in b_orders.control if isinstance(c, LoadWeights)] == [LoadWeights("/ckpt/1", 1, keep=True)]
        if during_b_load is not None:
            await during_b_load(loops, core, clock)
        for _ in range(800):
            clock["t"] += 0.01
            for rid in ("a", "b"):
                await loops[rid].step()
            await asyncio.sleep(0.001)
            done, _, finished = core.fetch(bid, 0, now())
            if finished:
                break
        assert finished
        return done, b_orders, share

    return asyncio.run(go())


# Regression: the Work was labelled with the version its replica held at dispatch, so its
# Completion said weight_versions == [(0, 0)] although every token came from version 1.
def test_work_sent_with_a_keep_load_is_labelled_with_the_new_version():
    done, b_orders, share = run_keep_update_with_work_waiting_for_b({})
    assert len(done) == 4 and not b_orders.start  # b's share went back to the queue
    for c in done:
        if c.index in share:  # it ran after the update, on a replica that held version 1
            assert c.weight_versions == [(0, 1)] and c.weights_version == 1, c.weight_versions


# Regression: the Work went out with b's keep load, and b's pull loop waited for the whole load
# before it started that work (EngineMoves.ready_for_work), pulling no more: its running
# sequences went unreported, and a load longer than router.replica_timeout_s had the router take
# b for dead (its work requeued, the load counted as a death toward breaking the version).
def test_a_replica_keeps_pulling_during_a_keep_load_when_work_was_waiting_for_it():
    async def during_b_load(loops, core, clock):
        b = loops["b"]
        assert b.moves.loading is not None  # b loads, held by the test
        pulls = core.fleet.replicas["b"].pulls
        for _ in range(3):
            clock["t"] += 0.01
            await asyncio.wait_for(b.step(), 5.0)  # not held up by the load
        assert core.fleet.replicas["b"].pulls == pulls + 3 and b.moves.loading is not None
        b.engine.release.set()

    done, b_orders, share = run_keep_update_with_work_waiting_for_b({"b": HeldLoadSimEngine}, during_b_load)
    assert len(done) == 4 and all(c.finish_reason == "length" for c in done) and not b_orders.start
    for c in done:
        if c.index in share:
            assert c.weight_versions == [(0, 1)], c.weight_versions


class RefusingSimEngine(SimEngine):
    """A replica whose keep load is refused (a bucket that does not fit): its old weights stay."""

    async def load_weights(self, path: str, keep_as=None) -> None:
        raise ValueError("tensor 'w': shape (3, 3), the served model's is (2, 2)")


# Regression: a replica whose keep load failed still started the Work that came with that load
# (labelled with the load's version by the router), on its old weights.
def test_work_that_comes_with_a_keep_load_that_fails_does_not_start_on_the_old_weights():
    async def go(engine_cls):
        eng = engine_cls(COST, time_scale=1e-4)
        info = await eng.start()
        loop = PullLoop(eng, EngineMoves(eng, CFG, "b"), None, replica_id="b", incarnation="i1", model=info,
                        router_cfg=RouterConfig(report_interval_s=0.01))
        work = Work("b0:1", 1, [1, 2, 3], SamplingSpec(max_tokens=6), None, prompt_len=3)
        await loop.apply(Orders(control=[LoadWeights("/ckpt/1", 1, keep=True)], start=[work]), [])
        return eng.held(), loop.moves.weights_version

    assert asyncio.run(go(RefusingSimEngine)) == ([], 0)  # not started: the next listing lacks it
    assert asyncio.run(go(SimEngine)) == ([("b0:1", 1)], 1)  # after the swap, on version 1
