"""A request that the engine ends with a retryable error (vLLM's finish_reason "error": a KV load
that failed, a cache miss; docs/semantics.md) continues from its tokens so far on whichever replica
takes it next, at most router.engine_error_retries times; any other error, or one past that bound,
ends the sequence with finish_reason "error" and says why. The adapter (engines/vllm_seqs.py) tells
the two apart; the router (router/reports.py) acts on it. No sequence is lost or returned twice."""
import asyncio
from collections import Counter
from types import SimpleNamespace

import pytest

from rollout_cluster.config import ClusterConfig, EngineConfig, PolicyConfig, load_config
from rollout_cluster.config.errors import ConfigError
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.engines.vllm_engine import VllmEngine
from rollout_cluster.engines.vllm_seqs import engine_error
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import EngineStats, ModelInfo, Report, SamplingSpec, SeqProgress, SequenceRequest, Work
from rollout_cluster.router.core import RouterCore

COST = load_profile("a100-80g-7b")


def core_with(retries=2, replicas=("a", "b")) -> RouterCore:
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=len(replicas),
                      replica_timeout_s=5.0, engine_error_retries=retries)
    for rid in replicas:
        report(core, rid, [], 0.0, model=ModelInfo(100, 64))
    return core


def report(core, rid, progress, now, model=None):
    """The replica's pull: its report applied, and the orders its reply carries."""
    return core.on_report(Report(rid, "i1", progress=progress, stats=EngineStats(), model=model, capacity=8), now)


def error_final(w, offset, retryable=True, why="engine: KV load failed"):
    return SeqProgress(w.seq_id, w.attempt, [], None, "error", error=why, retryable=retryable, offset=offset)


def fetch_all(core, bid):
    done, _, finished = core.fetch(bid, 0)
    assert finished
    return done


# ---- the router ---------------------------------------------------------------------------------
def test_a_retryable_engine_error_continues_from_the_tokens_so_far():
    core = core_with()
    bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=6, logprobs=0), 0, 0)], 0.0)
    w1 = core.decide("a", 0.0).start[0]
    report(core, "a", [SeqProgress(w1.seq_id, 1, [7, 8], [-0.1, -0.2], offset=0)], 0.1)
    w2 = report(core, "a", [error_final(w1, 2)], 0.2).start[0]  # requeued: the next pull takes it (a's own)
    assert (w2.seq_id, w2.attempt) == (w1.seq_id, 2)
    assert w2.prompt_token_ids == [1, 2, 7, 8] and w2.sampling.max_tokens == 4
    report(core, "a", [SeqProgress(w2.seq_id, 2, [9, 10, 11, 12], [-0.3] * 4, "length", offset=0)], 0.4)
    (c,) = fetch_all(core, bid)
    assert c.finish_reason == "length" and c.error is None
    assert c.token_ids == [7, 8, 9, 10, 11, 12] and c.logprobs == [-0.1, -0.2] + [-0.3] * 4
    assert [(m.source, m.at_token, m.reason) for m in c.migrations] == [("a", 2, "engine_error")]
    assert core.counters.engine_error_retries == 1 and core.counters.recovered == 1
    assert core.counters.migrations == 0  # not a policy's move


def test_past_the_bound_the_sequence_ends_in_error_naming_the_count_and_the_setting():
    core = core_with(retries=2)
    bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=20), 0, 0)], 0.0)
    made = []
    w = core.decide("a", 0.0).start[0]
    for attempt in (1, 2, 3):
        assert w.attempt == attempt and w.prompt_token_ids == [1, 2] + made
        report(core, "a", [SeqProgress(w.seq_id, attempt, [attempt], offset=0)], attempt + 0.1)
        made.append(attempt)
        orders = report(core, "a", [error_final(w, 1)], attempt + 0.2)  # (its pull takes the retry)
        w = orders.start[0] if orders.start else None
    assert w is None
    (c,) = fetch_all(core, bid)
    assert c.finish_reason == "error" and c.token_ids == [1, 2, 3]
    assert "KV load failed" in c.error and "3 times" in c.error and "router.engine_error_retries=2" in c.error
    assert core.counters.engine_error_retries == 2 and not core.seqs


@pytest.mark.parametrize("retries, retryable", [(2, False), (0, True)])
def test_an_error_not_retryable_or_with_retries_off_ends_the_sequence_at_once(retries, retryable):
    core = core_with(retries=retries)
    bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=6), 0, 0)], 0.0)
    w = core.decide("a", 0.0).start[0]
    report(core, "a", [SeqProgress(w.seq_id, 1, [5], offset=0)], 0.1)
    assert not report(core, "a", [error_final(w, 1, retryable=retryable, why="engine: ValueError: bad")], 0.2).start
    (c,) = fetch_all(core, bid)
    assert c.finish_reason == "error" and c.token_ids == [5]
    if retryable:  # retries off: the error says which setting ended it
        assert c.error.startswith("engine: ValueError: bad (") and "router.engine_error_retries=0" in c.error
    else:  # not the engine's failure: its own words, no retry count
        assert c.error == "engine: ValueError: bad"
    assert core.counters.engine_error_retries == 0 and not core.decide("b", 0.3).start


def test_a_cancelled_sequence_is_not_retried():
    core = core_with()
    bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=6), 0, 0)], 0.0)
    w = core.decide("a", 0.0).start[0]
    core.cancel(bid, 0.1)
    assert not report(core, "a", [error_final(w, 0)], 0.2).start
    (c,) = fetch_all(core, bid)
    assert c.finish_reason == "error" and core.counters.engine_error_retries == 0
    assert not core.decide("b", 0.3).start


def test_a_final_error_past_a_gap_continues_from_the_tokens_the_router_holds():
    """A final whose offset lies past the tokens the router holds (report_gap) and that is a
    retryable error: continued from what the router has, as a retry."""
    core = core_with()
    bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=6), 0, 0)], 0.0)
    w = core.decide("a", 0.0).start[0]
    report(core, "a", [SeqProgress(w.seq_id, 1, [5], offset=0)], 0.1)
    w2 = report(core, "a", [error_final(w, 3)], 0.2).start[0]  # tokens 1..2 of this attempt never came
    assert w2.prompt_token_ids == [1, 2, 5] and core.counters.engine_error_retries == 1
    report(core, "a", [SeqProgress(w2.seq_id, 2, [6, 7, 8, 9, 10], None, "length", offset=0)], 0.4)
    (c,) = fetch_all(core, bid)
    assert c.token_ids == [5, 6, 7, 8, 9, 10] and c.finish_reason == "length"


def test_a_batch_with_errors_returns_every_sequence_once():
    """Eight sequences on two replicas; replica a's engine ends every segment it runs with a
    retryable error after one token, replica b finishes what it gets. Each sequence ends once:
    at its full length where b ran it in time, else in error after its one retry."""
    core = core_with(retries=1)
    n = 8
    bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=3), i, 0) for i in range(n)], 0.0)
    held = {"a": [], "b": []}
    now = 0.0
    for _ in range(50):
        now += 1.0
        for rid in "ab":
            works, held[rid] = held[rid] + core.decide(rid, now).start, []
            for w in works:
                if rid == "a":
                    held["a"] += report(core, "a", [SeqProgress(w.seq_id, w.attempt, [9], offset=0)], now).start
                    progress = [error_final(w, 1)]
                else:
                    progress = [SeqProgress(w.seq_id, w.attempt, [4] * w.sampling.max_tokens, None, "length",
                                            offset=0)]
                held[rid] += report(core, rid, progress, now).start
        if not core.seqs:
            break
    done = fetch_all(core, bid)
    assert len(done) == n and sorted(c.prompt_index for c in done) == list(range(n))
    reasons = Counter(c.finish_reason for c in done)
    assert set(reasons) == {"length", "error"}, reasons  # both ways ran
    for c in done:
        if c.finish_reason == "length":
            assert len(c.token_ids) == 3
        else:
            assert c.token_ids == [9, 9] and "2 times" in c.error  # a ran it twice: once, then its one retry


def test_the_setting_is_checked_naming_field_and_value():
    with pytest.raises(ConfigError) as e:
        load_config({"router": {"engine_error_retries": -1}})
    assert "router.engine_error_retries" in str(e.value) and "-1" in str(e.value)
    assert ClusterConfig().router.engine_error_retries == 2


# ---- the adapter --------------------------------------------------------------------------------
class Out:
    def __init__(self, toks, finished=False, reason=None, error=None):
        self.outputs = [SimpleNamespace(token_ids=toks, finish_reason=reason, logprobs=None)]
        self.finished = finished
        self.num_cached_tokens = 0
        if error is not None:
            self.error = error


class ErrorLLM:
    errored = False

    def __init__(self, final: Out):
        self.final = final

    async def generate(self, prompt, params, request_id):
        yield Out([11, 12])
        yield self.final

    async def abort(self, ids):
        pass


def run_one(final: Out, llm=None) -> list:
    """One request through the adapter over `llm` (default: ErrorLLM ending with `final`): its reports."""
    async def main():
        eng = VllmEngine(EngineConfig(), "m", on_cpu=True)
        eng.engine = llm or ErrorLLM(final)
        eng.submit(Work("s", 1, [1, 2, 3], SamplingSpec(max_tokens=10)))
        for _ in range(100):
            await asyncio.sleep(0)
            if not eng.seqs.tasks:
                break
        return eng.drain()
    return asyncio.run(main())


def test_the_adapter_reports_vllms_error_finish_as_retryable_with_its_tokens():
    got = run_one(Out([13], finished=True, reason="error"))
    assert [p.token_ids for p in got] == [[11, 12], [13]]
    final = got[-1]
    assert final.finish_reason == "error" and final.retryable is True and final.offset == 2
    assert 'finish_reason "error"' in final.error


@pytest.mark.parametrize("retryable", [True, False])
def test_the_adapter_takes_vllms_request_error_flag_and_words(retryable):
    err = SimpleNamespace(code="kv_load_failed", message="KV blocks missing", retryable=retryable)
    final = run_one(Out([], finished=True, reason="error", error=err))[-1]
    assert final.retryable is retryable
    assert "kv_load_failed" in final.error and "KV blocks missing" in final.error


def test_a_request_vllm_refuses_is_not_retryable():
    class RefusingLLM(ErrorLLM):
        async def generate(self, prompt, params, request_id):
            raise ValueError("prompt too long")
            yield  # (a generator)

    (final,) = run_one(None, RefusingLLM(None))
    assert final.finish_reason == "error" and final.retryable is False and "prompt too long" in final.error


def test_engine_error_words_without_a_request_error():
    msg, retryable = engine_error(SimpleNamespace())
    assert retryable is True and "error" in msg
