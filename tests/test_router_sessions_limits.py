"""Session affinity, batch limits and a cancelled batch's traces in the router core, at edges a
review found: a resumed partial turn of a session waits for its home; a cancelled batch stops
holding limits.max_live_sequences at once; a late fetch of a dropped batch names the wait that
dropped it; cut-off lengths are no evidence for the policies. RouterCore driven directly."""
from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.protocol import EngineStats, ModelInfo, Report, SamplingSpec, SeqProgress, SequenceRequest
from rollout_cluster.router.core import RouterCore
from rollout_cluster.router.limits import BatchLimits

COST = load_profile("h200-1.5b", max_num_seqs=8)


def report(rid, progress=(), capacity=8) -> Report:
    return Report(rid, "i1", progress=list(progress), stats=EngineStats(), model=ModelInfo(1000, 4096),
                  capacity=capacity)


def new_core(replicas=("a", "b"), limits=None) -> RouterCore:
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), expected_replicas=len(replicas),
                      replica_timeout_s=5.0, limits=limits)
    for rid in replicas:
        core.on_report(report(rid), 0.0)
    return core


def test_a_resumed_partial_turn_of_a_session_goes_to_its_home_as_status_says():
    """docs/trainers.md: a session's turn is queued for the replica that ran its previous turn, which
    takes it at its next pull while it has a free slot; status()["sessions"] counts it as homed.
    A turn that resumes a partial rollout (output_token_ids, e.g. a JSONL line with "session" and
    "output_token_ids") was counted as homed but queued as a plain continuation: the first replica
    to pull took it, away from the prefix cache of its home."""
    core = new_core()
    bid = core.submit([SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=6), 0, 0, session="s")], 0.1)
    (work,) = core.on_report(report("a"), 0.2).start  # turn 1 runs on a
    core.cancel(bid, 0.3)  # cut (finish_fraction): a hands its partial back
    core.on_report(report("a", [SeqProgress(work.seq_id, work.attempt, [7, 8], None, "abort")]), 0.4)
    (c,), _, done = core.fetch(bid, 0, 0.4)
    assert done and c.finish_reason == "abort" and list(c.token_ids) == [7, 8]
    # the partial goes on in the next batch, same session: its context is cached on a
    core.submit([SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=6), 0, 0, session="s",
                                 output_token_ids=[7, 8])], 0.5)
    assert core.sessions.status()["homed_turns"] == 1  # counted as queued with its home (a)
    taken_by_b = core.on_report(report("b"), 0.6).start  # b pulls first; a has 8 free slots
    assert taken_by_b == [], "b took a turn whose live home has room for it"
    assert len(core.on_report(report("a"), 0.7).start) == 1


def test_a_cancelled_batch_stops_holding_max_live_sequences_at_once():
    """docs/trainers.md: a client that hangs up or times out cancels its batch: "its sequences stop
    holding replicas and limits.max_live_sequences at once". The running ones of a cancelled batch
    were counted as live until their replica's next report confirmed the give-up (up to
    router.replica_timeout_s if that replica hangs): the next batch (e.g. the partials of a batch
    cut at finish_fraction) was refused as a full router (RouterBusy, 429/503)."""
    core = new_core(replicas=("a",), limits=BatchLimits(max_batch_sequences=4, max_live_sequences=4))
    reqs = [SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=6), i, 0) for i in range(4)]
    bid = core.submit(reqs, 0.1)
    assert len(core.on_report(report("a"), 0.2).start) == 4  # all running on a
    assert core.cancel(bid, 0.3) == 4
    # no report from a yet: the give-ups are on their way
    core.submit([SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=6), i, 0) for i in range(4)], 0.35)


def test_a_late_fetch_of_a_dropped_cancelled_batch_names_the_wait_that_dropped_it():
    """router.abandoned_batch_s may be 10 (docs/configuration.md: >= 10); a cancelled batch then goes
    after min(10, 60) s without a fetch (Batches.abandoned). The late fetch's error said "60 s is the
    wait for a cancelled batch" for a batch dropped after 11 s: it names a wait that did not apply."""
    core = new_core(replicas=("a",))
    bid = core.submit([SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=6), 0, 0)], 0.0)
    core.cancel(bid, 0.5)
    assert core.drop_abandoned(11.0, 10.0) == [bid]
    try:
        core.fetch(bid, 0, 12.0)
    except KeyError as e:
        why = str(e)
    else:
        raise AssertionError("a dropped batch was fetched")
    assert "no fetch for 11 s" in why
    assert "60 s" not in why, why  # it waited router.abandoned_batch_s = 10 s, not 60


def test_a_cancelled_batch_adds_no_lengths_to_the_policies_evidence():
    """The policies estimate a typical length from recently finished sequences. A cancelled batch's
    sequences end as "abort" cut short (queued ones at 0 tokens): counted, one cancel of a large batch
    filled the window with zeros and the typical length collapsed."""
    core = new_core()
    bid = core.submit([SequenceRequest([1, 2, 3], SamplingSpec(max_tokens=6), i, 0) for i in range(40)], 0.1)
    (w,) = core.on_report(report("a", capacity=1), 0.2).start
    core.on_report(report("a", [SeqProgress(w.seq_id, w.attempt, [5, 6, 7], None, "stop")], capacity=1), 0.3)
    assert core.moves.finished_lengths == [3]
    assert core.cancel(bid, 0.4) == 39
    assert core.moves.finished_lengths == [3], "cut-off lengths counted as evidence"
