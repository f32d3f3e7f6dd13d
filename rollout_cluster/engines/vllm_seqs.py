"""VllmSeqs: the sequences VllmEngine runs in vLLM's AsyncLLM, and their reports. Part of
VllmEngine (vllm_engine.py), so it imports vllm.

It owns everything per attempt: the request's task, its context, the weights swapped under it
(and the fence that holds its outputs while a swap is applied, cutting them if the swap broke),
whether it was given up or its final goes whole, and the reports not yet drained (with the step
time and decode rate measured from them). The AsyncLLM stays the VllmEngine's (`engine`), which
starts it and which tests hand a fake one.
"""
from __future__ import annotations

from array import array

import asyncio
import json
import logging
import time

from ..protocol import EngineStats, SeqProgress, Work
from ..protocol.requests import MAX_CACHE_SALT_CHARS
from .vllm_params import sampled_logprobs, sampling_params

log = logging.getLogger(__name__)
_SALT_PAD = "~" * (MAX_CACHE_SALT_CHARS + 1)  # (makes an engine-made salt longer than any a request may bring)


def engine_error(out) -> tuple:
    """(message, retryable) of a request vLLM ended with finish_reason "error". vLLM documents that
    reason as a retryable request-level internal error (a KV load that failed, a multimodal cache
    miss); releases that attach a RequestError (`out.error`: code, message, retryable) say which."""
    err = getattr(out, "error", None)
    if err is None:
        return 'engine: vLLM ended the request with finish_reason "error" (a request-level failure inside it)', True
    code, message = getattr(err, "code", None), getattr(err, "message", None)
    retryable = getattr(err, "retryable", True)
    text = f"engine: vLLM ended the request with an error: {code or 'error'}: {message or err}"
    return text, retryable is True


class VllmSeqs:
    def __init__(self, owner, capacity: int):
        self.owner = owner  # the VllmEngine: its `engine` is vLLM's AsyncLLM, once started
        self.capacity = capacity
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
        # While a keep swap is applied (swap_into): the attempts that ran when it began, which take
        # in nothing vLLM makes from then until `fence_open` is set; then, if the swap broke the
        # weights, they are in `cut`: nothing more of theirs is kept, they end as "abort" at the
        # tokens they had (close_fence, open_fence, cut_fence).
        self.fenced: frozenset = frozenset()
        self.fence_open = asyncio.Event()
        self.cut: set = set()
        # attempts that got an output while they waited at the fence: vLLM ran them before the swap's
        # reply reached us (outputs reach the frontend in the EngineCore's order); one the worker no
        # longer held at the swap had finished, on the old weights (`swapped`: no mark)
        self.got_at_fence: set = set()
        self.aborted: set = set()
        self.whole: set = set()  # attempts whose final report carries their whole output (report_whole)
        # attempts ended with a delta final not yet delivered -> (work, tokens, logprobs, reason,
        # swaps): whole_final, and report_whole of an attempt that ended
        self.ended_whole: dict = {}
        self.pending: list = []
        self.ended = 0
        self.dead = None
        self._last_drain = time.monotonic()
        self._step_ema = 0.0
        self._rate_ema = 0.0

    @property
    def engine(self):
        """vLLM's AsyncLLM, the VllmEngine's (None before start and after shutdown)."""
        return self.owner.engine

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
                if key in self.fenced:  # a keep swap is applied under it: nothing of it until it is whole
                    self.got_at_fence.add(key)  # (vLLM ran it before the swap's reply came: `swapped`)
                    await self.fence_open.wait()
                if key in self.cut:  # ... and it broke the weights: this output and all after are dropped
                    continue
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
                    error, retryable = engine_error(out) if reason == "error" else (None, False)
                    if reason and key in self.whole:
                        self.pending.append(self._whole(work, made, made_lps, reason, self.swaps.get(key),
                                                        error, retryable))
                    else:
                        if reason:
                            self.ended_whole[key] = (work, made, made_lps, reason, self.swaps.get(key),
                                                     error, retryable)
                        self.pending.append(SeqProgress(work.seq_id, work.attempt, toks, lps, reason,
                                                        error=error, retryable=retryable,
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
            if key in self.cut:  # its weights broke (cut_fence): handed back at the tokens it had
                self._abort_final(work, key, made, made_lps, produced)
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
            self.cut.discard(key)
            self.got_at_fence.discard(key)

    def _abort_final(self, work: Work, key, made: array, made_lps: array, produced: int) -> None:
        if key in self.whole:
            self.pending.append(self._whole(work, made, made_lps, "abort", self.swaps.get(key)))
        else:
            self.ended_whole[key] = (work, made, made_lps, "abort", self.swaps.get(key), None, False)
            self.pending.append(SeqProgress(work.seq_id, work.attempt, [], None, "abort", offset=produced,
                                            swaps=self.swaps.get(key)))
        self.ended += 1

    @staticmethod
    def _whole(work: Work, made: array, made_lps: array, reason: str, swaps=None, error=None,
               retryable: bool = False) -> SeqProgress:
        """The final report of an attempt with its whole output (report_whole)."""
        lps = made_lps.tolist() if work.sampling.logprobs is not None and len(made_lps) == len(made) else None
        return SeqProgress(work.seq_id, work.attempt, made.tolist(), lps, reason, error=error, retryable=retryable,
                           offset=0,
                           prompt_token_ids=list(work.prompt_token_ids or ()), prior_logprobs=work.prior_logprobs,
                           swaps=swaps, weight_versions=work.weight_versions)

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
        work, made, made_lps, _, swaps, error, retryable = kept
        whole = self._whole(work, made, made_lps, p.finish_reason, swaps, error, retryable)
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
        # (divided by the attempts that made tokens or run now: one that ended inside the interval
        # brought its tokens, so it counts too)
        dt, running = now - self._last_drain, len(set(self.tasks) | {(p.seq_id, p.attempt) for p in out})
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

    def swapped(self, sampled: dict, version: int) -> None:
        """Weights `version` went in under the running requests (keep): each running attempt
        records the token where its weights changed (SeqProgress.swaps), and later requests
        carry the version in their cache salt."""
        for key in list(self.tasks):
            made = sampled.get(f"{key[0]}#{key[1]}")
            if made is None:  # not in vLLM's worker: still waiting (0 made), or finished already
                if self.seen.get(key, 0) or key in self.got_at_fence:
                    continue
                made = 0
            self.swaps.setdefault(key, []).append((made, version))
        self.salt_version = version

    def close_fence(self) -> None:
        """A keep swap is about to be applied: the attempts running now take in nothing vLLM makes
        from here on (it waits in vLLM's per-request output) until the swap is known to have gone
        in whole (open_fence) or to have broken the weights (cut_fence). So no report carries a
        token sampled after the swap began before it is known which weights sampled it."""
        self.fenced, self.fence_open = frozenset(self.tasks), asyncio.Event()

    def open_fence(self) -> None:
        """The swap is over (its marks recorded by `swapped`, or cut): the attempts go on."""
        self.fenced = frozenset()
        self.fence_open.set()

    async def cut_fence(self) -> None:
        """The swap broke the weights inside vLLM (a mix of old and new): every attempt fenced
        keeps only the tokens it took in before the swap began, none sampled since (they may come
        from the broken weights). Each ends as "abort" at those tokens, handed back as a replica
        that stops hands its work back (the router continues it elsewhere from them), and vLLM
        stops running it. The engine is restarted after (WeightsLoadBroken)."""
        cut = [k for k in self.fenced if k in self.tasks]
        self.cut.update(cut)
        self.open_fence()
        try:
            await self.give_up(cut)
        except Exception:  # their finals come when the replica stops (nothing after the fence either)
            log.exception("aborting %d requests whose weights broke failed", len(cut))

    def _salt(self, salt):
        """The request's prefix-cache salt: its own, and after a keep swap one that names the weights
        version too, in a form no request's salt can take (longer than MAX_CACHE_SALT_CHARS, and
        one salt and version to one string): blocks cached on the old weights under a request's
        salt "w2" are never reused after a swap to version 2."""
        if self.salt_version is None:
            return salt
        return json.dumps([salt, self.salt_version]) + _SALT_PAD
