"""Resubmissions that name one old id twice. In one batch that is the driver's mistake, refused
naming the field; across two batches (two drivers, or a driver that resubmitted twice) one
sequence waits for the old id's output and the other runs from its prompt: before, the second
waiter replaced the first in awaiting_orphans, and the first was in no queue and no wait list:
never dispatched, its batch never ended."""
import pytest

from rollout_cluster.protocol import InputError
from rollout_cluster.router import adoption as router_adoption
from test_router_adoption import new_router, request


def _run_all(core, now):
    started = []
    for k in range(5):
        started += core.decide("a", now + 0.01 * k).start
    return started


def test_two_batches_naming_one_old_id_both_run():
    core = new_router()
    first = core.submit([request(max_tokens=8)], 1.0, previous_ids=["r1-b0:0"])
    again = core.submit([request(max_tokens=8)], 1.1, previous_ids=["r1-b0:0"])
    ids = [f"{first}:0", f"{again}:0"]
    assert {w.seq_id for w in _run_all(core, 1.2)} == {ids[1]}  # the second runs from its prompt at once
    core.expire(1.2 + router_adoption.ADOPT_WAIT_S)  # no output came for the first: from the prompt too
    assert {w.seq_id for w in _run_all(core, 12.0)} == {ids[0]}


def test_one_batch_naming_an_old_id_twice_is_refused_naming_the_field():
    core = new_router()
    with pytest.raises(InputError, match=r"previous_ids='<3 ids>': names 'r1-b0:0' twice"):
        core.submit([request(), request(index=1), request(index=2)], 1.0, previous_ids=["r1-b0:0", None, "r1-b0:0"])
    assert not core.batches and not core.seqs
    core.submit([request(), request(index=1)], 1.0, previous_ids=[None, None])  # (None is no id: not a repeat)
