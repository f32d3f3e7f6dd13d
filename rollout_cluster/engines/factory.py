"""Engine adapters by config; vllm is imported only when a vLLM engine is asked for."""
from __future__ import annotations

from ..config import ClusterConfig
from .base import EngineAdapter
from .cost_model import load_profile


def make_engine(cfg: ClusterConfig, rank: int = 0) -> EngineAdapter:
    e = cfg.engine
    if e.kind == "sim":
        from .sim_engine import SimEngine

        return SimEngine(load_profile(cfg.profile_path(), e.max_num_seqs), e.sim_vocab_size, e.max_model_len,
                         e.sim_time_scale)
    from .vllm_engine import VllmEngine

    return VllmEngine(e, cfg.model_path(), rank, require_manifest=cfg.security.require_manifest)
