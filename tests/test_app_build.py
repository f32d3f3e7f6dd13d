"""`serve run rollout_cluster.serve.app:build config=...` builds the whole graph from YAML args."""
from pathlib import Path

import pytest

from rollout_cluster.config import ConfigError, load_config
from rollout_cluster.serve.app import build, replica_options

ROOT = Path(__file__).resolve().parents[1]


def deployments(app):
    from ray.serve._private.build_app import build_app

    built = build_app(app, name="rollout")
    return {d.name: d for d in built.deployments}


def test_build_from_yaml_path_binds_router_replicas_and_gateway():
    d = deployments(build({"config": str(ROOT / "configs" / "a100x32.yaml")}))
    assert set(d) == {"Router", "EngineReplica", "Gateway"}
    assert d["Router"].num_replicas == 1 and d["Router"].max_ongoing_requests == 4096
    assert d["EngineReplica"].num_replicas == 32
    assert d["EngineReplica"].ray_actor_options["num_gpus"] == 1
    assert d["Gateway"].max_ongoing_requests == 4096  # an HTTP batch holds its slot until it is done


def test_build_from_inline_mapping_and_bad_args_fail_clearly():
    d = deployments(build({"replicas": 3, "engine": {"kind": "sim"}}))
    assert d["EngineReplica"].num_replicas == 3
    with pytest.raises(ConfigError, match="replicas=0"):
        build({"replicas": 0})


def test_a_tensor_parallel_replica_holds_one_gpu_per_rank():
    cfg = load_config({"engine": {"tensor_parallel_size": 4}, "resources": {"num_gpus": 1, "num_cpus": 2}})
    opts = replica_options(cfg)
    assert opts["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 4.0}
    assert "placement_group_bundles" not in opts
    more = load_config({"engine": {"tensor_parallel_size": 2}, "resources": {"num_gpus": 3}})
    assert replica_options(more)["ray_actor_options"]["num_gpus"] == 3.0
    cpu = load_config({"engine": {"tensor_parallel_size": 2}, "resources": {"num_gpus": 0}})
    assert replica_options(cpu)["ray_actor_options"]["num_gpus"] == 0.0


def test_failed_replicas_are_found_and_stopping_ones_hand_back_without_serves_idle_waits():
    """A dead engine or stalled replica fails 3 health checks before Serve replaces it, a killed
    router 1: at a 2 s period, not Serve's 10 s. A stopping replica (it gets no Serve requests)
    hands its work back after a 0.2 s drain check, not Serve's 2 s."""
    d = deployments(build({"replicas": 2, "engine": {"kind": "sim"}}))
    assert cfg(d, "EngineReplica").health_check_period_s == 2 and cfg(d, "Router").health_check_period_s == 2
    assert cfg(d, "EngineReplica").graceful_shutdown_wait_loop_s == 0.2
    assert cfg(d, "EngineReplica").graceful_shutdown_timeout_s == 20  # the hand-back (10 s at most) fits


def cfg(d: dict, name: str):
    return d[name]._deployment_config
