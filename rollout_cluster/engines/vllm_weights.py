"""VllmWeights: the model's weights and memory in vLLM's AsyncLLM: loads from a checkpoint or from
pushed tensors, swaps under running requests (keep), digests, prefix-cache resets, sleep and wake.
Part of VllmEngine (vllm_engine.py), whose AsyncLLM and config it uses; the running requests are
the VllmSeqs' (vllm_seqs.py), which it asks to give orphans up and to record a keep swap.
"""
from __future__ import annotations

import asyncio
import logging

from ..transfer.trace import mark
from . import weight_checks, weight_digest, weight_keep, weight_loader
from .base import SleepRefused, WeightsLoadBroken
from .checkpoint import check_checkpoint

log = logging.getLogger(__name__)


class VllmWeights:
    def __init__(self, owner, seqs, model: str, require_manifest: bool = True):
        self.owner = owner  # the VllmEngine: its AsyncLLM (`engine`), config (`cfg`) and `on_cpu`
        self.seqs = seqs  # the VllmSeqs running on these weights
        self.require_manifest = require_manifest  # security.require_manifest: load only a sealed checkpoint
        self.weights_path = model  # the checkpoint (or, load_format dummy, the config) load_tensors checks names and shapes against
        # How the last load handed its buckets to vLLM's worker: weight_loader.WAYS -> buckets
        # ({}: none handed, the weights vLLM read from a checkpoint itself)
        self.handed: dict[str, int] = {}

    @property
    def engine(self):
        """vLLM's AsyncLLM, the VllmEngine's (None before start and after shutdown)."""
        return self.owner.engine

    async def load_weights(self, path: str, keep_as=None) -> None:
        # Before vLLM touches the model (it empties a layer before it reads its new tensors, and only
        # warns about missing ones): an incomplete checkpoint leaves the old weights. In a thread:
        # it may hash every file (the manifest's sha256).
        await asyncio.to_thread(check_checkpoint, path, self.require_manifest)
        if keep_as is not None:  # under the running requests: the checkpoint's tensors, swapped in
            await self.load_tensors(weight_keep.checkpoint_buckets(path), keep_as)
            self.weights_path = path
            return
        if self.seqs.tasks:  # the router orders a load only between batches: these are orphans of a
            log.warning("aborting %d requests left from before the weights load", len(self.seqs.tasks))
            await self.seqs.give_up(list(self.seqs.tasks))
        # vLLM's worker reloads in place from the checkpoint (model_executor/model_loader/reload).
        # A failure in there leaves the model half loaded: the caller must restart this engine.
        try:
            mark("reload_start")
            if self.owner.cfg.load_format == "dummy":  # vLLM's dummy loader reads no file: reload as safetensors
                await self.engine.collective_rpc("rc_reload_format", args=("auto",))
            await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": path})
            mark("reload_end")
        except Exception as e:
            raise WeightsLoadBroken(f"vLLM failed reloading {path!r}, its weights are now unknown: {e}") from e
        self.weights_path, self.handed = path, {}
        # The prefix cache's KV blocks were computed with the old weights.
        if not await self.engine.reset_prefix_cache():
            raise WeightsLoadBroken(f"weights from {path!r} loaded, but the prefix cache could not be reset")

    async def load_tensors(self, buckets, keep_as=None) -> int:
        if keep_as is not None:
            return await self._swap(buckets, keep_as)
        if self.seqs.tasks:  # as in load_weights: orphans of a restarted router
            log.warning("aborting %d requests left from before the tensors load", len(self.seqs.tasks))
            await self.seqs.give_up(list(self.seqs.tasks))
        spec = await asyncio.to_thread(weight_checks.load_spec, self.weights_path)
        handed: dict = {}
        n = await weight_loader.load_into(self.engine, buckets, spec, handed=handed)
        self.handed = handed
        if not await self.engine.reset_prefix_cache():
            raise WeightsLoadBroken(f"{n} tensors loaded, but the prefix cache could not be reset")
        return n

    async def _swap(self, buckets, version: int) -> int:
        """running="keep": the tensors swapped in between two steps; each running attempt
        records the token where its weights changed (SeqProgress.swaps)."""
        spec = await asyncio.to_thread(weight_checks.load_spec, self.weights_path)
        try:  # (a swap that breaks the weights cuts the running requests at the tokens they had)
            handed: dict = {}
            n, sampled = await weight_keep.swap_into(self.engine, buckets, spec, fence=self.seqs, handed=handed)
            self.handed = handed
            self.seqs.swapped(sampled, version)
        finally:
            self.seqs.open_fence()
        await self.engine.reset_prefix_cache()  # the blocks no running request holds; the salt does the rest
        return n

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.engine.reset_prefix_cache())

    async def weights_digest(self, detail: bool = False) -> dict:
        # each worker digests its model's parameters on its own device, between two engine steps
        return weight_digest.merge_workers(await self.engine.collective_rpc("rc_weights_digest"), detail)

    async def sleep(self, level: int = 1) -> None:
        if not self.owner.on_cpu and not self.owner.cfg.enable_sleep_mode:
            raise SleepRefused("engine.enable_sleep_mode is false: vLLM started without sleep mode and would free "
                               "no GPU memory; set it (vLLM then allocates through its CuMem allocator)")
        if self.seqs.tasks:  # the router sleeps engines between batches only: orphans of a restarted router
            log.warning("aborting %d requests left from before sleep", len(self.seqs.tasks))
            await self.seqs.give_up(list(self.seqs.tasks))
        # On the CPU build vLLM pauses its scheduler and drops the prefix cache; its worker frees nothing.
        await self.engine.sleep(level)

    async def wake(self) -> None:
        await self.engine.wake_up()

    async def sleeping(self) -> bool:
        return bool(await self.engine.is_sleeping())

