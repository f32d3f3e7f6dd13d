"""A push that does not fit the served model (a name it lacks, another shape, a tensor left out)
is refused before the engine takes its first bucket, so the replica keeps its old weights and
its engine: push_weights puts every bucket's names, dtypes and shapes in the object store ahead
of the buckets (transfer/buckets.py's manifest), and the replica checks them all first."""
import asyncio

import pytest
import ray
import torch
from safetensors.torch import save_file

from rollout_cluster.config import ClusterConfig, EngineConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.engines.sim_engine import SimEngine
from rollout_cluster.engines.vllm_engine import VllmEngine
from rollout_cluster.protocol import LoadWeights
from rollout_cluster.serve.engine_moves import EngineMoves, fetched
from rollout_cluster.transfer.push import PUSH_SCHEME, put_buckets

SERVED = {"a.weight": (4, 4), "b.weight": (4, 4), "c.weight": (4,)}


class AsyncLLMCalls:
    """vLLM's AsyncLLM as far as a load reaches it: the worker calls it gets, in order."""

    def __init__(self):
        self.calls = []

    async def collective_rpc(self, method, args=(), kwargs=None):
        self.calls.append(method)
        return [{}] if method == "rc_swap_apply" else [[]]

    async def reset_prefix_cache(self):
        return True


def pushed(bad: str) -> list:
    tensors = [(n, torch.ones(s)) for n, s in SERVED.items()]
    if bad == "shape":
        tensors[-1] = ("c.weight", torch.ones(5))
    elif bad == "name":
        tensors[-1] = ("c.wieght", torch.ones(4))
    elif bad == "missing":
        tensors = tensors[:-1]
    elif bad == "dtype":
        tensors[-1] = ("c.weight", torch.ones(4, dtype=torch.int32))
    return tensors


# Regression: pushed buckets reach the engine one by one as they arrive, and each was checked only
# when it came: a bad tensor in a later bucket (a tied lm_head sent by state_dict() comes last) was
# refused after the first buckets went in, so every replica's engine held a mix of two models and
# had to restart (WeightsLoadBroken), and a tensor left out was found only after the whole load.
@pytest.mark.parametrize("bad, says", [("shape", "tensor 'c.weight': shape (5,), the served model's is (4,)"),
                                       ("name", "tensor 'c.wieght': the served model has no such weight"),
                                       ("missing", "1 of the served model's 3 tensors are missing"),
                                       ("dtype", "tensor 'c.weight': dtype torch.int32 is not floating point")])
def test_a_push_that_does_not_fit_is_refused_before_the_engine_takes_a_bucket(tmp_path, monkeypatch, bad, says):
    save_file({n: torch.zeros(s) for n, s in SERVED.items()}, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(ray, "put", lambda obj: obj)  # the object store: a replica takes a dict as it is
    refs, _, _ = put_buckets(pushed(bad), bucket_bytes=64)  # one tensor a bucket
    assert len(refs) >= 3
    cfg = EngineConfig(model=str(tmp_path))
    eng = VllmEngine(cfg, str(tmp_path), on_cpu=True)
    eng.engine = AsyncLLMCalls()
    moves = EngineMoves(eng, ClusterConfig(engine=cfg), "r0")

    async def go():
        moves.apply(LoadWeights(f"{PUSH_SCHEME}p", 1, tuple(refs)))
        await moves.loading[1]

    asyncio.run(go())
    assert eng.engine.calls == []  # no bucket reached vLLM's worker
    assert moves.broken is None and moves.weights_version == 0  # old weights, no restart
    assert says in moves.weights_error and moves.weights_error_version == 1


@pytest.mark.parametrize("keep", [False, True])
def test_a_push_that_fits_loads_every_bucket_once_and_in_order(tmp_path, monkeypatch, keep):
    save_file({n: torch.zeros(s) for n, s in SERVED.items()}, str(tmp_path / "model.safetensors"))
    monkeypatch.setattr(ray, "put", lambda obj: obj)
    refs, tensors, _ = put_buckets(pushed("none"), bucket_bytes=64)
    assert tensors == 3
    cfg = EngineConfig(model=str(tmp_path))
    eng = VllmEngine(cfg, str(tmp_path), on_cpu=True)
    eng.engine = AsyncLLMCalls()
    moves = EngineMoves(eng, ClusterConfig(engine=cfg), "r0")

    async def go():
        moves.apply(LoadWeights(f"{PUSH_SCHEME}p", 1, tuple(refs), keep=keep))
        await moves.loading[1]

    asyncio.run(go())
    assert moves.weights_error is None and moves.weights_version == 1 and moves.broken is None
    if keep:  # staged while the engine runs on, swapped in at once
        assert eng.engine.calls == ["rc_swap_stage"] * 3 + ["rc_swap_apply"]
    else:
        assert eng.engine.calls == ["rc_tensors_begin"] + ["rc_tensors_load"] * 3 + ["rc_tensors_end"]


def test_a_simulated_engine_counts_the_tensors_of_a_push_not_its_manifest(monkeypatch):
    monkeypatch.setattr(ray, "put", lambda obj: obj)
    refs, _, _ = put_buckets(pushed("none"), bucket_bytes=64)
    eng = SimEngine(load_profile("h200-1.5b", max_num_seqs=8))

    async def go():
        return await eng.load_tensors(fetched(tuple(refs)))

    assert asyncio.run(go()) == 3 and eng.weights_source == "tensors:" + ",".join(SERVED)
