"""The vLLM engine adapter at its edges (engines/vllm_seqs.py, vllm_weights.py, weight_keep.py),
driven through fakes of vLLM's AsyncLLM (no engine runs): the keep swap's cache salt lives where no
request's salt can reach, the decode rate counts the sequences that made the tokens, and a request
vLLM finished just before a keep swap gets no mark of the new weights."""
import asyncio
from types import SimpleNamespace

import pytest
import torch

from rollout_cluster.config import EngineConfig
from rollout_cluster.engines import vllm_seqs
from rollout_cluster.engines.vllm_engine import VllmEngine
from rollout_cluster.engines.vllm_seqs import VllmSeqs
from rollout_cluster.protocol import SamplingSpec, SeqProgress, Work


@pytest.fixture(autouse=True)
def no_served_checkpoint(monkeypatch):
    """The served model "m" has no checkpoint or config here: the keep swap checks names only."""
    from rollout_cluster.engines import weight_checks

    monkeypatch.setattr(weight_checks, "load_spec", lambda path: None)


class Out:
    """A RequestOutput as vLLM's AsyncLLM yields it in DELTA mode (one completion, n=1)."""

    def __init__(self, toks, finished=False, reason=None):
        lps = [{t: SimpleNamespace(logprob=-0.25)} for t in toks]
        self.outputs = [SimpleNamespace(token_ids=toks, finish_reason=reason, logprobs=lps)]
        self.finished = finished
        self.num_cached_tokens = 0


def engine(llm) -> VllmEngine:
    eng = VllmEngine(EngineConfig(), "m", on_cpu=True)
    eng.engine = llm
    return eng


async def keep_swap(eng: VllmEngine, version: int):
    return await eng.load_tensors([[("model.norm.weight", torch.zeros(4))]], keep_as=version)


def through_a_keep_swap(llm, work: Work, version: int = 2, after_swap=None) -> list:
    """`work` submitted to an engine over `llm`, a keep swap to `version` once it runs in vLLM
    (then `after_swap()`), and its reports once it ended."""
    async def go():
        eng = engine(llm)
        eng.submit(work)
        await asyncio.sleep(0.01)  # the request runs in vLLM
        await keep_swap(eng, version)
        if after_swap is not None:
            after_swap()
        await asyncio.gather(*eng.seqs.tasks.values())
        return eng.drain()

    return asyncio.run(asyncio.wait_for(go(), 60.0))


# ---- 1. a keep swap marks a sequence that had finished on the old weights ------------------------
class FinishedJustBeforeTheSwapLLM:
    """Request "short#1" (one token left: a continuation near max_tokens, a first-token EOS) is
    prefilled and finished by vLLM in the step just before the EngineCore runs the swap's utility
    call. Its only output reaches the frontend while the replica awaits rc_swap_apply (the step's
    outputs and the utility's reply travel separately), and at apply time the request is no longer
    in the worker (finished)."""

    errored = False

    def __init__(self):
        self.step_done = asyncio.Event()
        self.aborted = set()

    async def generate(self, prompt, params, request_id):
        await self.step_done.wait()  # sampled in the step before the swap: old weights
        yield Out([100], finished=True, reason="length")

    async def abort(self, ids):
        self.aborted.update(ids)

    async def collective_rpc(self, method, args=(), kwargs=None):
        if method == "rc_swap_stage":
            return [1]
        if method == "rc_swap_apply":
            self.step_done.set()  # the step before the utility call finished the request ...
            await asyncio.sleep(0.01)  # ... and its output arrives while the swap's reply is awaited
            return [{"missing": [], "sampled": {}}]  # finished: not in model_runner.requests any more
        return None

    async def reset_prefix_cache(self):
        return True


def test_a_keep_swap_does_not_mark_a_sequence_that_finished_on_the_old_weights():
    """vllm_seqs.py VllmSeqs.swapped: a running attempt absent from the worker's `sampled` counts
    as "still waiting (0 made)" unless the replica already took in one of its tokens (`seen`). A
    request that vLLM finished in the step just before the swap, and whose only output the replica
    had not taken in yet (it waits at the fence, or is still in flight from the EngineCore), has
    seen == 0 and gets the mark (0, version): its report says every token it made came from the NEW
    weights, though all were sampled on the old ones (its Completion's weight_versions is wrong).
    Right, as the docstring says: "one it finished already gets no mark" - no swaps on its reports."""

    (final,) = through_a_keep_swap(FinishedJustBeforeTheSwapLLM(),
                                   Work("short", 1, [1, 2, 3], SamplingSpec(max_tokens=1, logprobs=0)))
    assert final.token_ids == [100] and final.finish_reason == "length"
    assert final.swaps is None, f"token 100 was sampled on the old weights, yet the report marks {final.swaps}"


class WaitingThroughTheSwapLLM(FinishedJustBeforeTheSwapLLM):
    """Request "late#1" waits in vLLM's queue through the swap (not in the worker: `sampled` lacks
    it) and makes its one token after it, on the new weights."""

    def __init__(self):
        super().__init__()
        self.swap_over = asyncio.Event()

    async def generate(self, prompt, params, request_id):
        await self.swap_over.wait()
        yield Out([200], finished=True, reason="length")

    async def collective_rpc(self, method, args=(), kwargs=None):
        if method == "rc_swap_apply":
            return [{"missing": [], "sampled": {}}]
        return await super().collective_rpc(method, args, kwargs)


def test_a_keep_swap_marks_a_sequence_still_waiting_at_its_first_token():
    llm = WaitingThroughTheSwapLLM()
    (final,) = through_a_keep_swap(llm, Work("late", 1, [1, 2, 3], SamplingSpec(max_tokens=1, logprobs=0)),
                                   after_swap=llm.swap_over.set)
    assert final.token_ids == [200] and final.swaps == [(0, 2)]


# ---- 2. the keep swap's cache salt can equal a request's own salt ---------------------------------
class SaltRecordingLLM:
    """Records each request's prefix-cache salt; requests run until aborted. reset_prefix_cache
    answers as vLLM 0.32's does while a request holds blocks: False, nothing dropped
    (BlockPool.reset_prefix_cache)."""

    errored = False

    def __init__(self):
        self.salts, self.aborted = {}, set()

    async def generate(self, prompt, params, request_id):
        self.salts[request_id] = prompt.get("cache_salt")
        for t in range(1000):
            if request_id in self.aborted:
                yield Out([], finished=True, reason="abort")
                return
            yield Out([100 + t])
            await asyncio.sleep(0.005)

    async def abort(self, ids):
        self.aborted.update(ids)

    async def collective_rpc(self, method, args=(), kwargs=None):
        if method == "rc_swap_apply":
            return [{"missing": [], "sampled": {}}]
        return [1]

    async def reset_prefix_cache(self):
        return not any(r not in self.aborted for r in self.salts)


def test_the_weights_version_salt_never_equals_a_salt_a_request_brought():
    """vllm_seqs.py VllmSeqs._salt: after a keep swap to version v an unsalted request gets the
    cache salt "w<v>", and a salted one "<salt>|w<v>", while before any keep swap a request's own
    salt goes to vLLM as it is. The namespaces overlap: a request that brought cache_salt "w2"
    (any 1-256 character string is valid) before the swap to version 2 cached its blocks, computed
    with the OLD weights, under "w2"; vLLM cannot drop them while the keep swap's requests run
    (reset_prefix_cache refuses), and every unsalted request after the swap is salted "w2" too, so
    it reuses old-weights KV (and a tenant that isolates itself with salt "w2" shares its cache
    with every unsalted request). Right: the engine's salts live in a namespace no request salt can
    name (a prefix/escape that user salts cannot produce), so the two salts differ."""

    async def go():
        llm = SaltRecordingLLM()
        eng = engine(llm)
        eng.submit(Work("tenant", 1, [1, 2, 3], SamplingSpec(max_tokens=1000, cache_salt="w2")))
        await asyncio.sleep(0.02)
        await keep_swap(eng, 2)  # under the running request: the keep swap
        eng.submit(Work("plain", 1, [1, 2, 3], SamplingSpec(max_tokens=1000)))
        await asyncio.sleep(0.02)
        await eng.give_up(eng.held())
        await asyncio.gather(*eng.seqs.tasks.values())
        return llm.salts

    salts = asyncio.run(asyncio.wait_for(go(), 60.0))
    assert salts["tenant#1"] == "w2"
    assert salts["plain#1"] != salts["tenant#1"], (
        "an unsalted request after the keep swap shares the prefix-cache namespace of a request "
        f"salted 'w2' on the old weights: both {salts['plain#1']!r}")


# ---- 3. the per-sequence decode rate counts ended sequences' tokens but not their time ------------
def test_the_decode_rate_divides_by_the_sequences_that_made_the_tokens(monkeypatch):
    """vllm_seqs.py VllmSeqs.drain: seq_tokens_per_s = (tokens of every report drained) /
    (len(self.tasks) at the drain x interval). A sequence that ended inside the interval (its final
    is in the drain) adds its tokens to the numerator but is no longer in `tasks`, so it is missing
    from the denominator: two sequences that each made 8 tokens in one second, one of which ended
    at the end of it, give 16 tokens/s per sequence instead of 8. The rate is biased high whenever
    sequences end (every interval of an RL batch's tail), and the router's calibration samples
    (router/tracing.py: (running, context, 1 / seq_tokens_per_s)) take it as the step time of
    `running` sequences. The docstring claims only a rate "averages them without bias". Right:
    divide by the sequences that made the tokens over the interval (those that reported, or ran
    during it), here 8.0."""
    clock = [100.0]
    monkeypatch.setattr(vllm_seqs.time, "monotonic", lambda: clock[0])
    seqs = VllmSeqs(SimpleNamespace(engine=None), 4)
    seqs._last_drain = 100.0
    seqs.tasks = {("a", 1): None}  # a runs on; b ended within the interval (its final is drained now)
    seqs.pending = [SeqProgress("a", 1, [7] * 8, offset=0),
                    SeqProgress("b", 1, [7] * 8, None, "length", offset=0)]
    clock[0] = 101.0
    seqs.drain()
    assert seqs.stats().seq_tokens_per_s == pytest.approx(8.0)
