"""A restarted router labels what it takes over with the weights versions that made it.

Regression (h-route9, item 1): adoption labelled every token it took over, a continuation's earlier
segments included, with the batch's version, and trusted the replica's version at the final
report for the whole segment. The old router's Work now carries the sequence's version marks up
to the segment's start (Work.weight_versions), the whole final brings them back with the swap
marks, and adoption labels from them; an output whose weights changed under it unmarked is not
taken (router/adoption.py)."""
import asyncio

from rollout_cluster.config import EngineConfig, PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.engines.vllm_engine import VllmEngine
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import (EngineStats, Listing, ModelInfo, Report, SamplingSpec, SeqProgress,
                                      SequenceRequest, WeightsState, Work)
from rollout_cluster.router.core import RouterCore

COST = load_profile("h200-1.5b", max_num_seqs=4)
PROMPT = [5, 6, 7]
V1 = "/ckpt/step-1"


def report(progress=(), held=None, version=1, path=V1) -> Report:
    return Report("a", "i1", progress=list(progress), stats=EngineStats(), model=ModelInfo(1000, 4096),
                  capacity=4, weights=WeightsState(version=version, path=path),
                  listing=None if held is None else Listing(held, []))


def new_router(version=1) -> RouterCore:
    """A restarted router whose one replica holds `version` (learned from its report)."""
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), id_prefix="r2-")
    core.on_report(report(version=version), 0.0)
    return core


def hand_over(core: RouterCore, out: SeqProgress, version=1) -> None:
    key = (out.seq_id, out.attempt)
    core.on_report(report(held=[key], version=version), 1.0)
    orders = core.on_report(report(held=[key], version=version), 1.1)
    assert key in orders.report_whole
    core.on_report(report([out], held=[], version=version), 1.2)


def whole(tokens, prompt, marks=None, swaps=None) -> SeqProgress:
    return SeqProgress("r1-b0:0", 2, list(tokens), None, "abort", offset=0, prompt_token_ids=list(prompt),
                       swaps=swaps, weight_versions=marks)


def request(max_tokens=10) -> SequenceRequest:
    return SequenceRequest(list(PROMPT), SamplingSpec(max_tokens=max_tokens), 0, 0)


def test_adopted_continuation_keeps_the_versions_of_its_earlier_segments():
    # old router: segment 1 made [4, 4] on version 0; an update (recompute) moved it to version 1,
    # where segment 2 made [3, 3] and ran when the router restarted
    core = new_router()
    hand_over(core, whole([3, 3], PROMPT + [4, 4], marks=[(0, 0), (2, 1)]))
    bid = core.submit([request(max_tokens=4)], 2.0, previous_ids=["r1-b0:0"])
    (c,), _, done = core.fetch(bid, 0)  # at max_tokens: finished at once
    assert done and list(c.token_ids) == [4, 4, 3, 3]
    assert c.weight_versions == [(0, 0), (2, 1)] and c.weights_version == 1


def test_adopted_output_keeps_a_keep_swap_inside_its_segment():
    core = new_router(version=2)
    # started on version 1 after 2 tokens of version 1; the engine swapped in 2 after 1 more token
    hand_over(core, whole([3, 3, 3], PROMPT + [4, 4], marks=[(0, 1)], swaps=[(1, 2)]), version=2)
    bid = core.submit([request(max_tokens=10)], 2.0, previous_ids=["r1-b0:0"])
    seq = core.seqs[f"{bid}:0"]
    assert seq.token_ids.tolist() == [4, 4, 3, 3, 3] and seq.weight_versions == [(0, 1), (3, 2)]


def test_an_output_whose_weights_changed_under_it_unmarked_is_not_adopted():
    # the attempt started on version 0 (its Work says so); the replica reports version 1 at its final:
    # the weights changed under it with no swap mark, so its tokens' versions are unknown
    core = new_router()
    hand_over(core, whole([3, 3], PROMPT, marks=[(0, 0)]))
    bid = core.submit([request()], 2.0, previous_ids=["r1-b0:0"])
    seq = core.seqs[f"{bid}:0"]
    assert seq.generated == 0 and core.counters.adopted == 0  # from its prompt


def test_a_continuation_whose_final_carries_no_versions_is_not_adopted():
    # an engine that does not send its Work's marks back: its earlier segments' versions are unknown
    core = new_router()
    hand_over(core, whole([3, 3], PROMPT + [4, 4]))
    bid = core.submit([request()], 2.0, previous_ids=["r1-b0:0"])
    assert core.seqs[f"{bid}:0"].generated == 0 and core.counters.adopted == 0


def test_a_first_segment_without_versions_is_still_adopted_on_the_replicas_version():
    core = new_router()
    hand_over(core, whole([3, 3], PROMPT))
    bid = core.submit([request()], 2.0, previous_ids=["r1-b0:0"])
    seq = core.seqs[f"{bid}:0"]
    assert seq.token_ids.tolist() == [3, 3] and seq.weight_versions == [(0, 1)]


def test_dispatched_work_carries_the_sequences_version_marks():
    core = new_router()
    core.submit([request()], 2.0)
    (w,) = core.decide("a", 2.1).start
    assert w.weight_versions == [(0, 1)]


class Out:
    def __init__(self, toks, finished=False, reason=None):
        self.outputs = [type("O", (), {"token_ids": toks, "finish_reason": reason, "logprobs": None})()]
        self.finished = finished


class TwoTokensLLM:
    errored = False

    async def generate(self, prompt, params, request_id):
        yield Out([8])
        yield Out([9], finished=True, reason="length")


def test_the_vllm_adapter_sends_its_works_version_marks_back_in_a_whole_final():
    async def go():
        eng = VllmEngine(EngineConfig(), "m", on_cpu=True)
        eng.engine = TwoTokensLLM()
        eng.report_whole([])  # (nothing asked yet)
        eng.submit(Work("r1-b0:0", 2, PROMPT + [4, 4], SamplingSpec(max_tokens=2),
                        weight_versions=[(0, 0), (2, 1)]))
        eng.report_whole([("r1-b0:0", 2)])
        await asyncio.gather(*eng.seqs.tasks.values())
        return eng.drain()

    (final,) = [p for p in asyncio.run(go()) if p.finish_reason]
    assert final.offset == 0 and final.token_ids == [8, 9] and final.weight_versions == [(0, 0), (2, 1)]
