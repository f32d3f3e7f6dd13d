"""SimEngine: SimEngineCore in real time, behind the EngineAdapter interface.

Replicas in Ray Serve can host it instead of vLLM (engine.kind: sim) to exercise the router,
the pull protocol and the policies at scale without a model. Never a stand-in for e2e tests.
"""
from __future__ import annotations

import asyncio

from ..protocol import EngineStats, ModelInfo, Work
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
        self.time_scale = time_scale  # wall seconds per modelled second (<1: faster than modelled); step times are reported in wall seconds
        self._wake = asyncio.Event()
        self._task = None
        self.modelled_s = 0.0  # modelled seconds of the current busy period
        self.swap_marks: dict = {}  # (seq_id, attempt) -> [(offset, version)]: swaps under it (keep)

    async def start(self) -> ModelInfo:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self.info

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        origin, self.modelled_s = loop.time(), 0.0  # wall time at modelled 0 of this busy period
        while True:
            if not self.core.busy:
                self._wake.clear()
                await self._wake.wait()
                origin, self.modelled_s = loop.time(), 0.0
            # Keep the modelled clock on the wall clock: a replica that was descheduled (a loaded
            # host) or slowed by its own pulls runs the steps it owes at once, instead of adding
            # every late wake-up to the batch's makespan.
            behind = (loop.time() - origin) / self.time_scale - self.modelled_s
            self.modelled_s += self.core.advance(limit_s=max(0.0, behind) + MAX_REAL_STEP_S / self.time_scale)
            ahead = origin + self.modelled_s * self.time_scale - loop.time()
            await asyncio.sleep(max(0.0, ahead))

    def submit(self, work: Work) -> None:
        self.core.submit(work)
        self._wake.set()

    async def give_up(self, keys: list) -> None:
        self.core.abort(keys)

    def drain(self) -> list:
        out = self.core.drain()
        if self.swap_marks:
            for p in out:
                key = (p.seq_id, p.attempt)
                marks = self.swap_marks.pop(key, None) if p.finish_reason else self.swap_marks.get(key)
                if marks:
                    p.swaps = list(marks)
        return out

    @property
    def ended(self) -> int:
        return self.core.ended

    def held(self) -> list:
        c = self.core
        return [(s.work.seq_id, s.work.attempt) for group in (c.running, c.waiting) for s in group]

    def stats(self) -> EngineStats:
        c = self.core
        return EngineStats(running=len(c.running), context_tokens=c.context,
                           step_time_s=c.last_step_s * self.time_scale)

    async def load_weights(self, path: str, keep_as=None) -> None:
        """A simulated engine has no weights: it takes the order, so the protocol runs as with vLLM."""
        self.weights_path = path
        self.weights_source = f"checkpoint:{path}"
        self._keep(keep_as)

    async def load_tensors(self, buckets, keep_as=None) -> int:
        """No weights here either: it counts the tensors (iterating the buckets, as vLLM would)
        and drops its cache as a load does."""
        from ..transfer.buckets import is_manifest

        names = []
        if hasattr(buckets, "__aiter__"):
            async for bucket in buckets:
                names += [] if is_manifest(bucket) else [name for name, _ in bucket]  # (a push's manifest)
        else:
            names = [name for bucket in buckets for name, _ in bucket]
        self.tensors_loaded = n = len(names)
        self.weights_source = "tensors:" + ",".join(names)
        self.core.prefix_cache.drop_free()
        self._keep(keep_as)
        return n

    def _keep(self, version) -> None:
        """A swap under the running sequences (keep): each one's next report marks it, at its offset."""
        if version is not None:
            for group in (self.core.running, self.core.waiting):
                for s in group:
                    self.swap_marks.setdefault((s.work.seq_id, s.work.attempt), []).append((s.produced, version))

    async def reset_prefix_cache(self) -> bool:
        self.core.prefix_cache.drop_free()
        return True

    async def weights_digest(self, detail: bool = False) -> dict:
        """No weights: a digest of where the last load came from (the checkpoint's path, or the
        pushed tensors' names), so that equal loads answer equal digests."""
        import hashlib

        source = getattr(self, "weights_source", "model:" + self.info.model)
        digest = hashlib.sha256(source.encode()).hexdigest()[:16]
        return {"digest": digest, "params": {"sim": {"digest": digest, "dtype": "none", "shape": []}}} if detail \
            else {"digest": digest}

    async def shutdown(self) -> None:
        if self._task:
            self._task.cancel()
