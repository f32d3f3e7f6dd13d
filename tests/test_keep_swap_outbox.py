"""running="keep" and work already on its way to a replica: a Work a push policy left in a
replica's outbox (assigned at another replica's pull) goes out in the same reply as the replica's
LoadWeights(keep). The replica starts that work only after the swap (EngineMoves.ready_for_work),
so every one of its tokens comes from the new weights; its Completion must say so."""
import asyncio


from rollout_cluster.config import ClusterConfig, EngineConfig, PolicyConfig, RouterConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.engines.sim_engine import SimEngine
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import LoadWeights, SamplingSpec, SequenceRequest
from rollout_cluster.router.core import RouterCore
from rollout_cluster.serve.engine_moves import EngineMoves
from rollout_cluster.serve.pull_loop import PullLoop

COST = load_profile("h200-1.5b", max_num_seqs=8)


# Regression: the Work was labelled with the version its replica held at dispatch, so its
# Completion said weight_versions == [(0, 0)] although every token came from version 1.
def test_work_sent_with_a_keep_load_is_labelled_with_the_new_version():
    core = RouterCore(make_policy(PolicyConfig(name="least-loaded"), COST), expected_replicas=2)
    cfg = ClusterConfig(engine=EngineConfig(kind="sim", model="sim"))
    clock = {"t": 0.0}

    def now():
        return clock["t"]

    async def go():
        loops, taken = {}, {}
        for rid in ("a", "b"):
            eng = SimEngine(COST, time_scale=1e-4)
            info = await eng.start()

            async def pull(report, rid=rid):
                orders = core.on_report(report, now())
                taken.setdefault(rid, []).append(orders)
                return orders

            loops[rid] = PullLoop(eng, EngineMoves(eng, cfg, rid), pull, replica_id=rid, incarnation="i1",
                                  model=info, router_cfg=RouterConfig(report_interval_s=0.01), clock=now)
        for rid in ("a", "b"):
            await loops[rid].step()  # both join on version 0
        bid = core.submit([SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=6), i, 0) for i in range(4)], now())
        clock["t"] += 0.01
        await loops["a"].step()  # least-loaded assigns to both: b's share waits in b's outbox
        assert core.outbox.get("b") and core.outbox.get("b").start
        assert core.update_weights("/ckpt/1", running="keep") == 1
        clock["t"] += 0.01
        await loops["b"].step()
        b_orders = taken["b"][-1]
        assert [c for c in b_orders.control if isinstance(c, LoadWeights)] == [LoadWeights("/ckpt/1", 1, keep=True)]
        assert b_orders.start  # the work goes out with the keep load, and starts after the swap
        for _ in range(400):
            clock["t"] += 0.01
            for rid in ("a", "b"):
                await loops[rid].step()
            await asyncio.sleep(0.001)
            done, _, finished = core.fetch(bid, 0, now())
            if finished:
                break
        assert finished
        return done

    done = asyncio.run(go())
    assert len(done) == 4
    b_done = [c for c in done if c.replicas == ["b"]]
    assert b_done
    for c in b_done:  # started after b swapped to version 1: every token is version 1's
        assert c.weight_versions == [(0, 1)] and c.weights_version == 1, c.weight_versions
