"""The Serve Router's status() over a real RouterCore, without Ray: every field it reports is read
from the core's components (a renamed attribute fails here, not in the e2e suite)."""
import asyncio
import time

from rollout_cluster.config import ClusterConfig, PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import EngineStats, ModelInfo, Report, SamplingSpec, SequenceRequest
from rollout_cluster.router.core import RouterCore
from rollout_cluster.serve.router import Router
from rollout_cluster.security.signing import OrderVerifier


def bare_router() -> Router:
    r = object.__new__(Router.func_or_class)
    r.cfg = ClusterConfig()
    r.core = RouterCore(make_policy(PolicyConfig(name="pull"), load_profile("a100-80g-7b")), 2, id_prefix="r1-")
    r.router_id, r.started_t = "r1", time.monotonic()
    r.verifier = OrderVerifier({}, allow_unsigned=True)
    return r


def test_status_reports_the_fleet_batches_weights_and_counters():
    r = bare_router()
    now = time.monotonic()
    r.core.on_report(Report("a", "i1", stats=EngineStats(step_time_s=0.01), model=ModelInfo(100, 64), capacity=4), now)
    bid = r.core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=4), 0, 0)], now)
    st = asyncio.run(r.status())
    assert st["replicas"] == {"a": {"running": 0, "capacity": 4, "pulls": 1, "step_time_s": 0.01}}
    assert st["queued"] == 1 and st["live_sequences"] == 1 and st["batches"] == 1
    assert list(st["batch_ids"]) == [bid] and st["batch_ids"][bid]["size"] == 1
    assert st["expected_replicas"] == 2 and st["policy"] == "pull"
    assert st["weights"] == {"version": 0, "path": None, "replicas": {"a": 0}, "held": ["a"], "handed": {"a": {}}, "errors": {},
                           "broken": [], "streaming": False, "aborted": None}
    assert st["sleep"]["level"] == 0 and st["counters"]["generated_tokens"] == 0
    assert st["model"] == {"vocab_size": 100, "max_model_len": 64, "model": "", "max_logprobs": 20,
                           "max_temperature": None}
