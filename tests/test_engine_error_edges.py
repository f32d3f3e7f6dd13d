"""Engine-error retries where they meet the rest of the router and the adapter: an error that
came with the last token, one that ends a segment the policy was giving up, an orphan's retryable
error under a restarted router; and the keep swap's mark of a request that ran before the swap."""

import pytest

from rollout_cluster.config import EngineConfig, PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.engines.vllm_engine import VllmEngine
from rollout_cluster.policy import make_policy
from rollout_cluster.policy.scripted import ScriptedPolicy
from rollout_cluster.protocol import EngineStats, ModelInfo, Report, SamplingSpec, SeqProgress, SequenceRequest, Work
from rollout_cluster.router.core import RouterCore

from test_engine_adapter_edges import FinishedJustBeforeTheSwapLLM, Out, through_a_keep_swap
from test_router_adoption import PROMPT, orphan_handed_over, new_router, request as adoption_request

COST = load_profile("a100-80g-7b")


@pytest.fixture(autouse=True)
def no_served_checkpoint(monkeypatch):
    from rollout_cluster.engines import weight_checks

    monkeypatch.setattr(weight_checks, "load_spec", lambda path: None)


def report(core, rid, progress, now, model=None):
    return core.on_report(Report(rid, "i1", progress=progress, stats=EngineStats(), model=model, capacity=8), now)


def core_with(policy=None, retries=2, replicas=("a", "b")) -> RouterCore:
    core = RouterCore(policy or make_policy(PolicyConfig(name="pull"), COST), expected_replicas=len(replicas),
                      replica_timeout_s=5.0, engine_error_retries=retries)
    for rid in replicas:
        report(core, rid, [], 0.0, model=ModelInfo(100, 64))
    return core


def error_final(seq_id, attempt, offset, toks=(), why="engine: KV load failed"):
    return SeqProgress(seq_id, attempt, list(toks), None, "error", error=why, retryable=True, offset=offset)


# ---- 1. a retryable error whose final reaches max_tokens -------------------------------------------
def test_a_retryable_error_at_max_tokens_ends_the_sequence_instead_of_sending_work_for_zero_tokens():
    """reports.py ended_in_error: the error final's tokens are taken in, then the sequence is
    requeued whatever it holds. One that reached max_tokens goes out as Work with max_tokens=0
    (SamplingSpec requires >= 1; vLLM refuses it, and the sequence then ends in a non-retryable error)."""
    core = core_with()
    bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=3), 0, 0)], 0.0)
    w = core.decide("a", 0.0).start[0]
    report(core, "a", [SeqProgress(w.seq_id, 1, [7, 8], offset=0)], 0.1)
    sent = report(core, "a", [error_final(w.seq_id, 1, 2, toks=[9])], 0.2).start
    sent += core.decide("b", 0.3).start
    assert all(work.sampling.max_tokens >= 1 for work in sent), \
        [(work.seq_id, work.sampling.max_tokens) for work in sent]
    done, _, finished = core.fetch(bid, 0)
    assert finished and len(done) == 1
    assert list(done[0].token_ids) == [7, 8, 9] and done[0].finish_reason == "length"


# ---- 2. an error that ends a segment the policy was giving up ---------------------------------------
def test_a_retryable_error_during_a_policy_give_up_is_counted_as_an_engine_error_retry_everywhere():
    """reports.py ended_in_error -> moves.requeue_after_segment(cause="engine_error"): the policy's
    give_up_t entry is still there, so the `ordered` branch records a policy migration (reason
    "policy", counters.migrations) and drops the cause: counters.engine_error_retries counts the
    retry, counters.recovered (documented to count it too) and the Completion's migrations do not."""
    core = core_with(policy=ScriptedPolicy([2]))
    bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=6), 0, 0)], 0.0)
    w = core.decide("a", 0.0).start[0]
    orders = report(core, "a", [SeqProgress(w.seq_id, 1, [7, 8], offset=0)], 0.1)
    assert (w.seq_id, 1) in orders.give_up  # the policy's move reached the replica ...
    retried = report(core, "a", [error_final(w.seq_id, 1, 2)], 0.2).start  # ... whose engine ended it with an error
    assert core.counters.engine_error_retries == 1
    rid, w2 = ("a", retried[0]) if retried else ("b", core.decide("b", 0.3).start[0])  # (the next pull takes it)
    report(core, rid, [SeqProgress(w2.seq_id, 2, [9] * 4, None, "length", offset=0)], 0.4)
    (c,), _, _ = core.fetch(bid, 0)
    assert c.finish_reason == "length" and list(c.token_ids) == [7, 8] + [9] * 4
    assert core.counters.recovered == core.counters.engine_error_retries == 1, \
        (core.counters.recovered, core.counters.migrations)
    assert [m.reason for m in c.migrations] == ["engine_error"]


# ---- 3. a restarted router and an orphan that ended in a retryable error ----------------------------
def test_an_orphan_that_ended_in_a_retryable_error_is_continued_from_its_tokens():
    """adoption.py take_final refuses every final with finish_reason "error" (before 382bfc7 such a
    final ended the sequence). A retryable one is now a segment that continues from its tokens
    (as an "abort" final is): its whole output is dropped and the resubmission starts again from
    its prompt."""
    core = new_router()
    out = SeqProgress("r1-b0:3", 1, [11, 12, 13, 14], [-1.0, -2.0, -3.0, -4.0], "error",
                      error="engine: KV load failed", retryable=True, offset=0, prompt_token_ids=list(PROMPT))
    orphan_handed_over(core, out)
    core.submit([adoption_request(max_tokens=10)], 2.0, previous_ids=["r1-b0:3"])
    (work,) = core.decide("a", 2.1).start
    assert work.prompt_token_ids == PROMPT + [11, 12, 13, 14] and work.sampling.max_tokens == 6


# ---- 4. the keep swap's mark of a request vLLM finished before the swap -----------------------------
class TwoOutputsBeforeTheSwapLLM(FinishedJustBeforeTheSwapLLM):
    """Request "two#1" makes two tokens in the two steps before the swap's utility call and
    finishes (max_tokens=2): both outputs reach the frontend while the swap's reply is awaited. The
    replica takes in the first at the fence (not final), the second waits behind it; at apply time
    the request is no longer in the worker."""

    async def generate(self, prompt, params, request_id):
        await self.step_done.wait()
        yield Out([100])
        yield Out([101], finished=True, reason="length")


def test_a_keep_swap_does_not_mark_at_token_0_a_request_whose_outputs_came_at_the_fence():
    """vllm_seqs.py `swapped`: a request the worker no longer holds, that holds a non-final output
    at the fence (its final behind it), ran before the swap: it is not "still waiting", and gets no
    mark (0, version), which would label token 100, sampled before the swap, as the new weights'."""

    out = through_a_keep_swap(TwoOutputsBeforeTheSwapLLM(),
                              Work("two", 1, [1, 2, 3], SamplingSpec(max_tokens=2, logprobs=0)))
    assert [p.token_ids for p in out] == [[100], [101]]
    assert all(not p.swaps or p.swaps[0][0] >= 1 for p in out), [p.swaps for p in out]
