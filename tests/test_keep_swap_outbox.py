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


def run_keep_update_with_work_waiting_for_b(engines: dict):
    """Two replicas on version 0; a batch that least-loaded splits at a's pull (b's share waits in
    b's outbox); update_weights(running="keep"); both replicas pull until the batch is done.
    Returns (the completions, the orders b took)."""
    core = RouterCore(make_policy(PolicyConfig(name="least-loaded"), COST), expected_replicas=2)
    cfg = ClusterConfig(engine=EngineConfig(kind="sim", model="sim"))
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
        for _ in range(800):
            clock["t"] += 0.01
            for rid in ("a", "b"):
                await loops[rid].step()
            await asyncio.sleep(0.001)
            done, _, finished = core.fetch(bid, 0, now())
            if finished:
                break
        assert finished
        return done, b_orders

    return asyncio.run(go())


# Regression: the Work was labelled with the version its replica held at dispatch, so its
# Completion said weight_versions == [(0, 0)] although every token came from version 1.
def test_work_sent_with_a_keep_load_is_labelled_with_the_new_version():
    done, _ = run_keep_update_with_work_waiting_for_b({})
    assert len(done) == 4
    b_done = [c for c in done if c.replicas == ["b"]]
    assert b_done
    for c in b_done:  # started after b swapped to version 1: every token is version 1's
        assert c.weight_versions == [(0, 1)] and c.weights_version == 1, c.weight_versions


class RefusingSimEngine(SimEngine):
    """A replica whose keep load is refused (a bucket that does not fit): its old weights stay."""

    async def load_weights(self, path: str, keep_as=None) -> None:
        raise ValueError("tensor 'w': shape (3, 3), the served model's is (2, 2)")


# Regression: when b's keep load failed, b still started the Work that came with it, on its old
# weights (version 0), and its Completion said every token was version 1's.
def test_work_sent_with_a_keep_load_that_fails_does_not_run_on_the_old_weights():
    done, b_orders = run_keep_update_with_work_waiting_for_b({"b": RefusingSimEngine})
    assert b_orders.start and len(done) == 4 and all(c.finish_reason == "length" for c in done)
    b_share = [c for c in done if c.replicas[0] == "b"]
    assert len(b_share) == len(b_orders.start)
    for c in b_share:  # b holds version 0 throughout: what is labelled version 1 ran on a
        assert c.weight_versions == [(0, 1)] and c.replicas[-1] == "a", (c.replicas, c.weight_versions)
