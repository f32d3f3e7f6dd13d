"""resources.* as the deployment asks Ray for them, and the values Ray would refuse refused by the
config, naming the key. No cluster is started: Serve's own build_app turns the app into deployments."""
import pytest

from rollout_cluster.config import ConfigError, load_config
from rollout_cluster.serve.app import build, replica_options


def test_a_fractional_gpu_per_replica_is_what_the_replica_asks_for_or_is_refused():
    """docs/architecture.md ("Sleep mode") tells a trainer that shares the GPUs with the engines to
    use Ray's fractional `resources.num_gpus`, and the field says "Ray GPUs per replica". But
    replica_gpus() returns max(num_gpus, tensor_parallel_size) = 1.0 for num_gpus 0.5 at TP 1: the
    operator's 0.5 is silently replaced, a trainer actor asking for the other 0.5 of that GPU (or a
    second replica) can never be placed there, and a fleet needs twice the GPUs the config says."""
    cfg = load_config({"resources": {"num_gpus": 0.5, "num_cpus": 1}})
    assert replica_options(cfg)["ray_actor_options"]["num_gpus"] == 0.5
    tp2 = load_config({"resources": {"num_gpus": 0.5}, "engine": {"tensor_parallel_size": 2}})
    assert replica_options(tp2)["ray_actor_options"]["num_gpus"] == 2.0  # a GPU per rank


def test_a_cpu_fraction_ray_refuses_is_a_config_error_naming_the_key():
    """resources.num_cpus=0.00001 passes load_config (rule: >= 0), then Ray's option check refuses
    it while the app is built ("The precision of the fractional quantity of resource num_cpus
    cannot go beyond 0.0001"): a bare ValueError that names no config key, and a traceback from
    `rollout-cluster serve` / the Ray job instead of their one-line refusal (cli.refusing only
    catches ConfigError)."""
    with pytest.raises(ConfigError, match=r"resources\.num_cpus=1e-05: must be 0 or >= 0.0001"):
        build({"engine": {"kind": "sim"}, "resources": {"num_cpus": 0.00001}})
    with pytest.raises(ConfigError, match=r"resources\.num_gpus=5e-05: must be 0 or >= 0.0001"):
        load_config({"resources": {"num_gpus": 0.00005}})
