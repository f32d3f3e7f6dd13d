"""A restarted router takes over an orphan's output only if its replica holds the router's weights:
the same version number from the same source.

Regression (h-rev9): adoption compared the replica's version number alone with the batch's. A
replica cut off from a restarted router past router.replica_timeout_s still holds version 3 from
the old router's checkpoint while the new router numbered another checkpoint 3 (the case
FleetWeights.holds was made for): its orphan's tokens, made by the old weights, were taken over
and labelled version 3 of the new router's weights."""
from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import (EngineStats, Listing, ModelInfo, Report, SamplingSpec, SeqProgress,
                                      SequenceRequest, WeightsState)
from rollout_cluster.router.core import RouterCore

COST = load_profile("h200-1.5b", max_num_seqs=4)
TIMEOUT_S = 60.0
PROMPT = [5, 6, 7]
OLD, NEW = "/ckpt/old-3", "/ckpt/new-3"


def pull(core, rid, now, version=0, path="", progress=(), held=None):
    return core.on_report(Report(rid, "i1", progress=list(progress), stats=EngineStats(),
                                 model=ModelInfo(1000, 4096), capacity=4,
                                 weights=WeightsState(version=version, path=path),
                                 listing=None if held is None else Listing(held, [])), now)


def test_an_orphan_made_on_a_renumbered_version_from_other_weights_is_not_adopted():
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=2,
                      replica_timeout_s=TIMEOUT_S, id_prefix="r2-")
    pull(core, "a", 0.0)
    assert core.update_weights(NEW, 3, now=TIMEOUT_S + 1) == 3  # b was not heard: its 3 is unknown
    pull(core, "a", TIMEOUT_S + 2, version=3, path=NEW)
    # b comes back holding the old router's version 3 (another checkpoint), running an old segment
    key = ("r1-b0:0", 1)
    t = TIMEOUT_S + 3
    for i in range(2):
        orders = pull(core, "b", t + 0.1 * i, version=3, path=OLD, held=[key])
    assert key in orders.report_whole
    final = SeqProgress("r1-b0:0", 1, [3, 3], None, "length", offset=0, prompt_token_ids=list(PROMPT),
                        weight_versions=[(0, 3)])
    pull(core, "b", t + 0.3, version=3, path=OLD, progress=[final], held=[])
    bid = core.submit([SequenceRequest(list(PROMPT), SamplingSpec(max_tokens=10), 0, 0)], t + 0.4,
                      previous_ids=["r1-b0:0"])
    seq = core.seqs[f"{bid}:0"]
    # made by the old weights: generated again from the prompt on the router's version 3
    assert core.counters.adopted == 0 and seq.generated == 0, seq.weight_versions


def test_a_goodbye_naming_no_source_does_not_make_a_cut_off_replicas_orphan_current():
    # the goodbye report names the version only (serve/pull_loop.py goodbye): the router must keep
    # the source it knows for that number, not take the replica for current by its number
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=2,
                      replica_timeout_s=TIMEOUT_S, id_prefix="r2-")
    pull(core, "a", 0.0)
    assert core.update_weights(NEW, 3, now=TIMEOUT_S + 1) == 3
    pull(core, "a", TIMEOUT_S + 2, version=3, path=NEW)
    key = ("r1-b0:0", 1)
    t = TIMEOUT_S + 3
    bid = core.submit([SequenceRequest(list(PROMPT), SamplingSpec(max_tokens=10), 0, 0)], t,
                      previous_ids=["r1-b0:0"])  # resubmitted first: it waits for the old segment's output
    for i in range(2):
        orders = pull(core, "b", t + 0.1 + 0.1 * i, version=3, path=OLD, held=[key])
    assert key in orders.report_whole
    final = SeqProgress("r1-b0:0", 1, [3, 3], None, "abort", offset=0, prompt_token_ids=list(PROMPT),
                        weight_versions=[(0, 3)])
    core.on_report(Report("b", "i1", progress=[final], stats=EngineStats(), model=None, capacity=4,
                          weights=WeightsState(version=3), leaving=True), t + 0.4)  # Serve stops b
    seq = core.seqs[f"{bid}:0"]
    assert core.counters.adopted == 0 and seq.generated == 0, seq.weight_versions
