"""The environment an engine starts with (engines/engine_env.py): a replica's GPU engine drops the
OMP_NUM_THREADS that Ray gives its workers, so it runs as a bare AsyncLLM does; the config can set
it for both; a vLLM-CPU engine keeps its own core binding."""
from __future__ import annotations

import pytest

from rollout_cluster.config import EngineConfig, load_config
from rollout_cluster.config.errors import ConfigError
from rollout_cluster.engines.engine_env import apply_engine_env, engine_env


def test_a_gpu_engine_in_a_ray_worker_drops_rays_thread_count():
    env = {"OMP_NUM_THREADS": "4", "PATH": "/bin"}  # as Ray leaves it in a worker with num_cpus=4
    changed = apply_engine_env(EngineConfig(), 0, on_cpu=False, environ=env)
    assert env == {"PATH": "/bin"}
    assert changed == {"OMP_NUM_THREADS": "4"}


def test_a_gpu_engine_outside_ray_is_left_as_it_is():
    env = {"PATH": "/bin"}
    assert apply_engine_env(EngineConfig(), 0, on_cpu=False, environ=env) == {}
    assert env == {"PATH": "/bin"}


def test_the_config_sets_the_thread_count_for_replica_and_bare_engine_alike():
    cfg = EngineConfig(omp_num_threads=2)
    for start in ({"OMP_NUM_THREADS": "4"}, {}):
        env = dict(start)
        apply_engine_env(cfg, 0, on_cpu=False, environ=env)
        assert env == {"OMP_NUM_THREADS": "2"}


def test_a_cpu_engine_is_bound_to_its_core_and_keeps_omp():
    cfg = EngineConfig(cpu_kv_cache_gib=3, omp_num_threads=2)
    put, drop = engine_env(cfg, 1, on_cpu=True)
    assert drop == ()
    assert put["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert "OMP_NUM_THREADS" not in put
    env = {"OMP_NUM_THREADS": "1"}
    apply_engine_env(cfg, 1, on_cpu=True, environ=env)
    assert env["OMP_NUM_THREADS"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"


@pytest.mark.parametrize("bad", [0, -1, "four", True])
def test_a_bad_thread_count_is_refused_naming_the_field(bad, tmp_path):
    path = tmp_path / "c.yaml"
    import yaml

    path.write_text(yaml.safe_dump({"engine": {"omp_num_threads": bad}}))
    with pytest.raises(ConfigError) as e:
        load_config(str(path))
    assert "engine.omp_num_threads" in str(e.value) and str(bad) in str(e.value)
