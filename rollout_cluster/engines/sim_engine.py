"""SimEngine: SimEngineCore in real time, behind the EngineAdapter interface.

Replicas in Ray Serve can host it instead of vLLM (engine.kind: sim) to exercise the router,
the pull protocol and the policies at scale without a model. Never a stand-in for e2e tests.
"""
from __future__ import annotations

import asyncio

from ..types import EngineStats, ModelInfo, Work
from .base import EngineAdapter
from .cost_model import CostModel
from .sim_core import SimEngineCore

MAX_REAL_STEP_S = 0.02  # wake at least this often so give-ups land promptly


class SimEngine(EngineAdapter):
    def __init__(self, cost: CostModel, vocab_size: int = 32000, max_model_len: int = 1 << 20,
                 time_scale: float = 1.0):
        self.core = SimEngineCore(cost, vocab_size)
        self.capacity = cost.max_num_seqs
        self.info = ModelInfo(vocab_size, max_model_len, f"sim:{cost.name}")
        self.time_scale = time_scale  # <1 runs faster than modelled time
        self._wake = asyncio.Event()
        self._task = None
        self._slept = 0.0

    async def start(self) -> ModelInfo:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self.info

    async def _run(self) -> None:
        while True:
            if not self.core.busy:
                self._wake.clear()
                await self._wake.wait()
            dt = self.core.advance(limit_s=MAX_REAL_STEP_S / self.time_scale)
            await asyncio.sleep(dt * self.time_scale)

    def submit(self, work: Work) -> None:
        self.core.submit(work)
        self._wake.set()

    async def give_up(self, keys: list) -> None:
        self.core.abort(keys)

    def drain(self) -> list:
        return self.core.drain()

    def held(self) -> list:
        c = self.core
        return [(s.work.seq_id, s.work.attempt) for group in (c.running, c.waiting) for s in group]

    def stats(self) -> EngineStats:
        c = self.core
        return EngineStats(running=len(c.running), waiting=len(c.waiting), context_tokens=c.context,
                           kv_usage=c.context / c.cost.kv_tokens, step_time_s=c.last_step_s)

    async def load_weights(self, path: str) -> None:
        """A simulated engine has no weights: it takes the order, so the protocol runs as with vLLM."""
        self.weights_path = path

    async def shutdown(self) -> None:
        if self._task:
            self._task.cancel()
