"""RouterCore at its edges: leftovers of a restarted router, requests no check foresaw, batch ids."""
import pytest

from rollout_cluster.config import PolicyConfig
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.router.core import RouterCore
from rollout_cluster.protocol import (EngineStats, InputError, Listing, ModelInfo, Report, SamplingSpec,
                                      SeqProgress, SequenceRequest)

COST = load_profile("h200-1.5b", max_num_seqs=4)


def make_core(prefix=""):
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), 1, 1e9, id_prefix=prefix)
    core.on_report(Report("a", "a-1", model=ModelInfo(100, 64), capacity=4), 0.0)
    return core


def listing(held, aborting=(), progress=()):
    return Report("a", "a-1", progress=list(progress), stats=EngineStats(), model=None, capacity=4,
                  listing=Listing(list(held), list(aborting)))


def test_attempts_the_router_does_not_know_are_given_up_once_two_listings_show_them():
    core = make_core("new-")
    bid = core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=50), 0, 0)], 0.0)
    (mine,) = core.decide("a", 0.0).start
    old = ("old-b0:0", 1)  # the restarted router's predecessor sent it
    assert core.on_report(listing([old, (mine.seq_id, mine.attempt)]), 1.0).give_up == []
    assert core.on_report(listing([old, (mine.seq_id, mine.attempt)]), 3.0).give_up == [old]
    assert core.counters.orphans_given_up == 1
    # while its abort is on its way it is listed as aborting: not given up again
    assert core.on_report(listing([old, (mine.seq_id, mine.attempt)], aborting=[old]), 5.0).give_up == []
    assert core.on_report(listing([old, (mine.seq_id, mine.attempt)], aborting=[old]), 7.0).give_up == []
    # its abort report is ignored; the router's own sequence is untouched and completes
    core.on_report(listing([(mine.seq_id, mine.attempt)],
                           progress=[SeqProgress("old-b0:0", 1, [9], None, "abort", offset=0)]), 8.0)
    core.on_report(listing([], progress=[SeqProgress(mine.seq_id, mine.attempt, [4] * 50, None, "length")]), 9.0)
    (done,) = core.fetch(bid, 0)[0]
    assert done.token_ids == [4] * 50 and core.counters.orphans_given_up == 1


def test_an_attempt_listed_once_while_its_final_is_drained_is_not_given_up():
    core = make_core()
    core.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=3), 0, 0)], 0.0)
    (w,) = core.decide("a", 0.0).start
    key = (w.seq_id, w.attempt)
    final = SeqProgress(w.seq_id, w.attempt, [1, 2, 3], None, "length")
    assert core.on_report(listing([key], progress=[final]), 1.0).give_up == []  # final and listing together
    assert core.on_report(listing([]), 3.0).give_up == [] and core.counters.orphans_given_up == 0


def test_batch_ids_carry_the_routers_prefix():
    core = make_core("r1a2b3-")
    bid = core.submit([SequenceRequest([1], SamplingSpec(max_tokens=2), 0, 0)], 0.0)
    assert bid == "r1a2b3-b0" and all(s.startswith("r1a2b3-b0:") for s in core.seqs)


def test_a_request_no_check_foresaw_fails_alone_and_the_batch_runs():
    core = make_core()
    reqs = [SequenceRequest([1, 2], SamplingSpec(max_tokens=2), i, 0) for i in range(3)]
    reqs[1] = SequenceRequest([1, 2], SamplingSpec(max_tokens=2, stop_token_ids=None), 1, 0)
    reqs.append(SequenceRequest([1, 2], "greedy", 3, 0))
    bid = core.submit(reqs, 0.0)
    errors = {c.prompt_index: c.error for c in core.fetch(bid, 0)[0]}
    assert errors[1].startswith("stop_token_ids=None") and errors[3].startswith("sampling='greedy'")
    assert len(core.decide("a", 0.0).start) == 2  # the other two run


def test_a_batch_with_something_other_than_requests_is_refused_whole():
    core = make_core()
    with pytest.raises(InputError, match=r"requests\[1\]=\[1, 2\]: must be a SequenceRequest"):
        core.submit([SequenceRequest([1], SamplingSpec(), 0, 0), [1, 2]], 0.0)
    assert not core.batches and not core.seqs and len(core.queue) == 0
