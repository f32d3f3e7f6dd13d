"""The driver package at its edges (client/): a stream that fails on its own cancels its batch; a
JSONL line resumed with its sample_index comes back as that sample, so a sample cut twice keeps its
seed; update_weights and push_weights refuse a path or tensors that are plainly wrong before they
wait for the fleet; prompts that are no list are refused by name (a generator is taken); a batch's
timeout_s bounds its submit's wait for a live replica. No Ray, no engines: the fake Serve handle of
test_router_restart, a RouterCore, the JSONL reader."""
import asyncio
import json
import os
import pathlib

import pytest

from rollout_cluster.client.client import RolloutClient
from rollout_cluster.client.expand import expand
from rollout_cluster.client.jsonl import merge_results, read_requests
from rollout_cluster.protocol import InputError, SamplingSpec

from test_router_adoption import new_router
from test_router_restart import Call, FakeRouter, Method, client_over


# ---- stream: a failure of its own cancels the batch, as generate's does --------------------------

def test_a_stream_that_fails_on_a_fetch_error_cancels_its_batch():
    """loops.run_sync cancels its batch whenever it stops before the end ("Ctrl-C, an error raised
    to it"), and its docstring says run_async does the same. run_async only cancels on
    CancelledError/GeneratorExit: when the follower fails the batch itself (a fetch error that is
    no router death, a completion returned twice), `raise action.error` leaves the batch running
    on the router for nobody until router.abandoned_batch_s (900 s), holding replicas beside the
    trainer's next batch. RolloutClient.stream and the HTTP Gateway both go through it."""
    router = FakeRouter(per_fetch=2)

    def boom():
        raise ValueError("the router's own error")
    router.before_fetch = [lambda: None, boom]
    client = client_over(router)

    async def collect():
        got = []
        with pytest.raises(ValueError, match="the router's own error"):
            async for c in client.stream([[5, 6]] * 10, SamplingSpec(max_tokens=4)):
                got.append(c)
        await asyncio.sleep(0.05)  # (a cancel that is not waited for has its moment)
        return got

    got = asyncio.run(collect())
    (batch,) = router.core.batches.values()
    assert 0 < len(got) < 10
    assert batch.cancelled, "the stream raised but left its batch running"
    left = [s for s in router.core.seqs.values() if s.batch_id == batch.batch_id]
    assert left and all(s.cancelled for s in left)


# ---- JSONL: a resumed line keeps its sample's place ----------------------------------------------

def test_a_resumed_jsonl_line_comes_back_with_its_sample_index_so_a_second_cut_keeps_its_seed():
    """jsonl.py: 'an output line with finish_reason "abort" resumes as an input line with its
    token_ids and logprobs as the output_ fields, and its sample_index (so that a seeded sample
    keeps its own seed)'. read_requests seeds such a line as sample 3 but makes its request sample
    0, so its output line says sample_index 0: cut again (the next step's finish_fraction), it
    resumes as sample 0, seed + 0, the seed of its group's sample 0. Two samples of one prompt cut
    twice before their first token then start again with one seed: the same sample twice, which
    the Partial path (resume.partials keeps the Partial's sample_index) was fixed to prevent."""
    base = {"prompt_token_ids": [5, 6, 7], "max_tokens": 8, "seed": 100}
    lines = [json.dumps({**base, "output_token_ids": [], "sample_index": j}) for j in (0, 3)]
    reqs, errors = read_requests(lines)
    assert not errors and [r.sampling.seed for r in reqs] == [100, 103]

    core = new_router()
    bid = core.submit(reqs, 1.0)
    core.cancel(bid, 1.1)  # cut again while queued: both come back "abort" with no token
    results, _, done = core.fetch(bid, 0)
    assert done
    out = merge_results(len(lines), reqs, sorted(results, key=lambda c: c.index), errors)
    assert [o["finish_reason"] for o in out] == ["abort", "abort"]
    assert [o["sample_index"] for o in out] == [0, 3]

    # the documented rule once more: each output line fed back with its sample_index
    again = [json.dumps({**base, "output_token_ids": o["token_ids"], "sample_index": o["sample_index"]})
             for o in out]
    reqs2, errors2 = read_requests(again)
    assert not errors2
    assert [r.sampling.seed for r in reqs2] == [100, 103], "a sample cut twice is reseeded as sample 0"


# ---- update_weights / push_weights: refused before the fleet is waited for -----------------------

def _no_router_client() -> RolloutClient:
    return object.__new__(RolloutClient)  # no router: reaching it raises AttributeError


@pytest.mark.parametrize("bad", [None, "", "   ", 7])
def test_update_weights_refuses_a_path_that_is_no_path_before_the_fleet_is_waited_for(bad):
    """fleet_ops.update_weights checks version and running up front, but sends `path` unchecked:
    before_update first polls the router (with running="finish", the default, it waits for every
    running sequence to end, up to timeout_s = 600 s), and only then does the router refuse
    `path=None: must be a non-empty path string`. Right: InputError naming path, no router call."""
    with pytest.raises(InputError, match=r"^path="):
        _no_router_client().update_weights(bad)


class Ordered(Exception):
    """The weights order reached the router (the test stops there)."""


def _settled_client(sent: list) -> RolloutClient:
    """A client whose router reports a settled, awake fleet and records the update_weights order."""
    status = {"sleep": {"level": 0, "errors": {}}, "live_sequences": 0,
              "weights": {"version": 0, "held": ["a"], "replicas": ["a"], "errors": {}}}
    router = type("Router", (), {})()
    router.status = Method(lambda: status)

    def order(path, version, running):
        sent.append(path)
        raise Ordered()
    router.update_weights = Method(order)
    client = object.__new__(RolloutClient)
    client.router, client.call_timeout_s, client.config = router, 5.0, None
    return client


def test_update_weights_sends_a_pathlib_path_as_the_absolute_path_string():
    """A trainer's checkpoint folder is most often a pathlib.Path. update_weights makes a str path
    absolute (the router checks it against security.checkpoint_roots, replicas on other nodes
    load it), but passes anything else on as it is: a Path goes to the router unconverted (and
    relative), which refuses it as no path string, after the fleet was waited for."""
    sent = []
    with pytest.raises(Ordered):
        _settled_client(sent).update_weights(pathlib.Path("ckpt") / "step-10")
    assert sent == [os.path.abspath(os.path.join("ckpt", "step-10"))]


@pytest.mark.parametrize("named", [{"w": "torch.zeros(2)"}, []], ids=["a state_dict", "nothing"])
def test_push_weights_refuses_named_tensors_that_are_no_pairs_before_the_fleet_is_waited_for(named):
    """push_weights(model.state_dict()) (the dict, not .items(): the commonest slip) iterates the
    keys, and push_weights([]) has nothing to push; both are found only inside push(), after
    before_update polled the router and (running="finish") waited for every running sequence to
    end, up to timeout_s. A mapping and an empty sized collection can be refused at once, naming
    named_tensors, as bucket_bytes and running are."""
    if isinstance(named, dict):
        import torch

        named = {"w": torch.zeros(2)}
    with pytest.raises((ValueError, TypeError), match="named_tensors"):
        _no_router_client().push_weights(named)


# ---- expand: prompts that are no list --------------------------------------------------------

@pytest.mark.parametrize("bad", [None, 7], ids=["None", "an int"])
def test_prompts_that_are_no_list_are_refused_naming_the_field(bad):
    """generate(prompts=None) or a lone int crashes expand with "TypeError: object of type
    'NoneType' has no len()", naming nothing, where `sessions` and `hidden_lengths` of the same
    kind are refused by name (expand.py, test_driver_edges)."""
    with pytest.raises(InputError, match=r"^prompts="):
        expand(bad, SamplingSpec(max_tokens=4))


def test_prompts_given_as_a_generator_are_taken_or_refused_by_name():
    """A trainer's `(tokenize(x) for x in batch)`: expand calls len(prompts) first and crashes with
    "TypeError: object of type 'generator' has no len()". Either take the prompts (list(prompts))
    or refuse them naming `prompts`."""
    try:
        reqs = expand((p for p in [[1, 2], [3]]), SamplingSpec(n=2, max_tokens=4))
    except InputError as e:
        assert str(e).startswith("prompts=")
    else:
        assert [(r.prompt_index, r.sample_index) for r in reqs] == [(0, 0), (0, 1), (1, 0), (1, 1)]


# ---- timeout_s bounds the wait for a live replica too ---------------------------------------------

def test_a_batch_timeout_bounds_the_submits_wait_for_a_live_replica():
    """generate(..., timeout_s=30) on a fleet with no live replica (engines starting, Serve
    replacing them): the submit names no wait, so the router waits router.submit_wait_for_replica_s
    (600 s) and the driver bounds the call by call_timeout_s + 600 = 720 s; timeout_s is looked at
    only once the batch exists. The step that asked for 30 s blocks up to 12 minutes (and if a
    replica comes at 200 s the batch is made, then cancelled as timed out). Right: the submit asks
    the router to wait no longer than the batch's timeout_s, and bounds its call by that."""
    from test_router_restart import SlowSubmitRouter, requests

    class Recording(SlowSubmitRouter):
        def __init__(self, replica_in_s):
            super().__init__(replica_in_s)
            self.waits = []
            slow = self.submit_batch.remote

            def remote(reqs, wait_for_replica_s=None, *rest):
                self.waits.append(wait_for_replica_s)
                return slow(reqs, wait_for_replica_s, *rest)
            self.submit_batch.remote = remote

    router = Recording(replica_in_s=200.0)
    client = client_over(router)
    client.call_timeout_s = 120.0
    try:
        client.run_requests(requests(4), timeout_s=30.0)
    except Exception:  # (refused or timed out: either is the batch's timeout honoured)
        pass
    wait = 600.0 if router.waits[0] is None else router.waits[0]
    assert wait <= 30.0, f"the router was asked to wait {wait:g} s for a replica on a batch of timeout_s=30"
    assert router.bounds[0] <= 30.0 + client.call_timeout_s, router.bounds
