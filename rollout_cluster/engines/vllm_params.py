"""What goes into vLLM and comes out of it: the engine args from the config, a request's sampling
params, the sampled tokens' logprobs, and probes of the installed build. Part of VllmEngine
(vllm_engine.py): like the other vllm_*.py modules it imports vllm, lazily, inside each function.
"""
from __future__ import annotations

from ..config import EngineConfig
from ..protocol import Work
from . import weight_keep


def engine_args(cfg: EngineConfig, model: str):
    import dataclasses

    from vllm.engine.arg_utils import AsyncEngineArgs

    extra = {}
    fields = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    if "stream_interval" in fields:  # not in every vLLM
        extra["stream_interval"] = cfg.stream_interval
    if "worker_extension_cls" in fields:  # load_tensors' and the keep swap's methods, mixed into vLLM's worker
        extra["worker_extension_cls"] = weight_keep.EXTENSION
    if cfg.tensor_parallel_size > 1 and not is_cpu_build():
        # The ranks run on the replica actor's own GPUs (serve/app.py, replica_gpus). Said
        # explicitly: in a placement group vLLM would pick its Ray executor instead.
        extra["distributed_executor_backend"] = "mp"
    return AsyncEngineArgs(**extra,
        model=model,
        load_format=cfg.load_format,
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        max_num_seqs=cfg.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        tensor_parallel_size=cfg.tensor_parallel_size,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        enable_prefix_caching=cfg.enable_prefix_caching,
        logprobs_mode=cfg.logprobs_mode,
        enforce_eager=cfg.enforce_eager,
        enable_sleep_mode=cfg.enable_sleep_mode and not is_cpu_build(),  # the CPU build refuses it
        seed=cfg.seed,
        skip_tokenizer_init=True,
        disable_log_stats=True,
    )


def sampling_params(work: Work):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    s = work.sampling
    max_tokens = s.max_tokens if work.stop_after is None else min(s.max_tokens, work.stop_after)
    return SamplingParams(
        n=1, max_tokens=max_tokens, min_tokens=min(s.min_tokens, max_tokens), temperature=s.temperature,
        top_p=s.top_p, top_k=max(0, s.top_k), min_p=s.min_p,
        ignore_eos=s.ignore_eos, logprobs=s.logprobs, stop_token_ids=list(s.stop_token_ids), seed=s.seed,
        repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, detokenize=False, output_kind=RequestOutputKind.DELTA,
    )


def max_temperature():
    """2.0 where this vLLM's SamplingParams refuses a higher temperature (newer releases do, as
    OpenAI's API does), else None: the router then refuses such a request up front, naming it."""
    from vllm import SamplingParams

    try:
        SamplingParams(temperature=2.5)
    except Exception:  # VLLMValidationError (a ValueError in some releases, not in others)
        return 2.0
    return None


def sampled_logprobs(token_ids: list, logprobs) -> list | None:
    """vLLM gives one {token_id: Logprob} per position; keep the sampled token's logprob."""
    if logprobs is None:
        return None
    return [float(pos[t].logprob) for t, pos in zip(token_ids, logprobs)]


def is_cpu_build() -> bool:
    try:
        from vllm.platforms import current_platform

        return current_platform.is_cpu()
    except Exception:  # older layouts
        import torch

        return not torch.cuda.is_available()
