"""The router's process is killed (Serve starts a new one, which knows nothing of the old one's
batches): a driver's generate still returns every sequence once, in its place, by submitting
again what it had not received. A fleet that sleeps keeps sleeping through the restart, and
wakes on the weights an update made while it slept names."""
import json
import threading
import time
import urllib.request

import pytest
import ray

from e2e_support import ROOT, http_request
from rollout_cluster.client.expand import expand
from rollout_cluster.model_maker import make_model
from rollout_cluster.protocol import SamplingSpec
from test_sleep_mode import wake_on_the_update_then_restore
from test_weights_update import GREEDY, PROMPTS, by_prompt, tokens

pytestmark = pytest.mark.e2e


def kill_router() -> str:
    (actor,) = [a for a in ray.util.list_named_actors(all_namespaces=True) if "#Router#" in a["name"]]
    ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
    return actor["name"]


def kill_router_once_finished(client, n: int, caller: threading.Thread, out: dict) -> None:
    """Kill the router once a batch has `n` sequences finished and its caller (a driver, or the
    Gateway) has had time to fetch them: the rest are still running."""
    deadline = time.monotonic() + 300
    while not any(b["finished"] >= n for b in client.status()["batch_ids"].values()):
        assert time.monotonic() < deadline and caller.is_alive(), out
        time.sleep(0.2)
    time.sleep(1.5)  # the caller's long-poll fetches them
    kill_router()


def run_requests_in_thread(client, requests) -> tuple:
    """(the thread running client.run_requests(requests), the dict its results or error land in)."""
    out = {}

    def run():
        try:
            out["results"] = client.run_requests(requests, timeout_s=600)
        except Exception as e:  # noqa: BLE001 (the test reports it)
            out["error"] = e

    driver = threading.Thread(target=run)
    driver.start()
    return driver, out


def new_router_status(client, old_id: str, timeout_s: float = 300) -> dict:
    """The status of the router Serve started after `old_id`, once both replicas pull from it."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            st = client.status()
            if st["router_id"] != old_id and len(st["replicas"]) == 2:
                return st
        except Exception:  # the killed one, under the call
            pass
        assert time.monotonic() < deadline, "no new router with both replicas"
        time.sleep(0.5)


def test_generate_returns_every_sequence_once_across_a_router_restart(client, fresh_policy):
    # Every long sequence migrates at 30 tokens: what the new router takes over are continuations,
    # whose earlier segments' logprobs come back with their whole output (Work.prior_logprobs).
    fresh_policy("scripted", scripted_at_tokens=[30])
    # The same weights as a new version: the new router must learn it from the replicas, and the
    # resubmission asks for it (the batch's samples all come from one version).
    version = client.update_weights(str(ROOT / "models" / "tiny-llama"))
    old_id = client.status()["router_id"]
    # The short ones are fetched before the kill; the long ones still run when the new router
    # lists them (it takes 15-30 s to answer here), so it takes their output over.
    lengths = [20] * 16 + [2000] * 48
    requests = expand([[60 + i, 7, 8] for i in range(len(lengths))],
                      [SamplingSpec(max_tokens=n, ignore_eos=True, logprobs=0) for n in lengths])
    restarts = client.router_restarts
    driver, out = run_requests_in_thread(client, requests)
    kill_router_once_finished(client, 16, driver, out)
    driver.join(300)
    assert not driver.is_alive(), f"generate still waits 300 s after the kill: {client.status()}"
    assert "error" not in out, out.get("error")
    results = out["results"]
    assert [c.index for c in results] == list(range(len(lengths)))
    assert [len(c.token_ids) for c in results] == lengths
    assert all(c.finish_reason == "length" and len(c.logprobs) == len(c.token_ids) for c in results)
    assert {c.weights_version for c in results} == {version}
    first = {c.batch_id for c in results if c.batch_id.startswith(old_id[:6])}
    again = [c for c in results if not c.batch_id.startswith(old_id[:6])]
    assert len(first) == 1 and again  # the first router's one batch, then the new router's
    assert client.router_restarts == restarts + 1

    st = new_router_status(client, old_id)
    assert all(c.batch_id.startswith(st["router_id"][:6]) for c in again)
    # What the old router's segments generated was kept: those sequences continued from it
    taken = [c for c in again if [m.reason for m in c.migrations] == ["router_restart"]]
    assert taken and st["counters"]["adopted"] >= len(taken), [c.migrations for c in again]
    assert all(30 < c.migrations[0].at_token <= 2000 and c.replicas[0] in st["replicas"] for c in taken)
    # the segments the old router had running were given up, not left to fill the slots
    deadline = time.monotonic() + 60
    while any(r["running"] for r in client.status()["replicas"].values()):
        assert time.monotonic() < deadline, client.status()
        time.sleep(0.5)
    assert len(client.generate([[9, 9, 9]], SamplingSpec(n=4, max_tokens=8, ignore_eos=True))) == 4


def test_sequences_that_end_while_the_router_is_down_are_not_generated_again(client, fresh_policy):
    """Killed a few tokens into a batch of short sequences, which all end on the replicas before
    Serve's new router answers (15-30 s here): the replicas' pulls failed, so they send those
    finals whole, and the new router finishes the driver's resubmission from them at once."""
    fresh_policy("pull")
    old_id = client.status()["router_id"]
    n, length = 24, 240
    requests = expand([[40 + i, 7, 8] for i in range(n)],
                      [SamplingSpec(max_tokens=length, ignore_eos=True, logprobs=0)] * n)
    driver, out = run_requests_in_thread(client, requests)
    deadline = time.monotonic() + 120
    while client.status()["counters"]["generated_tokens"] < n * 10:
        assert time.monotonic() < deadline and driver.is_alive(), out
        time.sleep(0.1)
    kill_router()
    driver.join(300)
    assert not driver.is_alive() and "error" not in out, out.get("error") or "generate still waits"
    results = out["results"]
    assert [c.index for c in results] == list(range(n)) and {len(c.token_ids) for c in results} == {length}
    assert all(c.finish_reason == "length" and len(c.logprobs) == length for c in results)
    st = new_router_status(client, old_id)
    again = [c for c in results if not c.batch_id.startswith(old_id[:6])]  # not fetched before the kill
    # ended under the old router, taken whole: nothing generated again
    whole = [c for c in again if [(m.reason, m.at_token) for m in c.migrations] == [("router_restart", length)]]
    all_whole = bool(again) and len(whole) == len(again)
    assert all_whole, [(c.index, c.migrations, c.batch_id) for c in again]
    assert st["counters"]["adopted"] >= len(again) and st["counters"]["generated_tokens"] == 0, st["counters"]


def test_http_generate_answers_every_line_across_a_router_restart(client, fresh_policy):
    """The HTTP route runs in the Gateway, a deployment of its own: it submits again what the
    killed router's batch had not returned, as the driver does, and answers every line."""
    fresh_policy("pull")
    lengths = [16] * 4 + [1500] * 20
    lines = [json.dumps({"prompt_token_ids": [80 + i, 7], "max_tokens": n, "ignore_eos": True, "logprobs": 0})
             for i, n in enumerate(lengths)]
    out = {}

    def post():
        try:
            req = http_request(client.config, "/generate?timeout_s=600", ("\n".join(lines) + "\n").encode(), "POST")
            with urllib.request.urlopen(req, timeout=700) as r:
                out["status"], out["body"] = r.status, r.read().decode()
        except Exception as e:  # noqa: BLE001 (reported below)
            out["error"] = e

    old_id = client.status()["router_id"]
    sender = threading.Thread(target=post)
    t0 = time.monotonic()
    sender.start()
    kill_router_once_finished(client, 4, sender, out)
    killed_s = time.monotonic() - t0
    sender.join(400)
    assert not sender.is_alive() and "error" not in out, out.get("error") or "no answer 400 s after the kill"
    records = [json.loads(line) for line in out["body"].splitlines()]
    assert out["status"] == 200 and len(records) == len(lengths)
    assert [len(r["token_ids"]) for r in records] == lengths
    assert all(r["finish_reason"] == "length" and len(r["logprobs"]) == n for r, n in zip(records, lengths))
    assert min(r["finish_time_s"] for r in records[4:]) > killed_s  # the long ones: made by the new router
    assert new_router_status(client, old_id)["router_id"] != old_id


def test_a_sleeping_fleet_sleeps_through_a_router_restart_and_wakes_on_the_update(client, tmp_path):
    original = str(ROOT / "models" / "tiny-llama")
    before = by_prompt(tokens(client))
    client.sleep(1)
    other = make_model(str(tmp_path / "step"), seed=2)
    v = client.update_weights(str(other))  # asleep: noted by every engine, loaded at wake
    old_id = client.status()["router_id"]
    kill_router()

    st = new_router_status(client, old_id)  # it learns the level and the note from the replicas
    assert st["sleep"]["level"] == 1 and set(st["sleep"]["replicas"].values()) == {1}
    with pytest.raises(Exception, match=r"asleep \(level 1"):
        client.generate(PROMPTS, GREEDY)
    wake_on_the_update_then_restore(client, v, before, original)


def test_an_update_right_after_a_router_restart_is_numbered_above_the_fleets_version(client):
    """Regression (review): a restarted router that had not heard its replicas yet numbered an
    update 1 while they held a higher version, so that one version named two sets of weights. It
    refuses weights orders (WeightsNotLearned) until every replica reported, and the driver's
    update_weights asks again within its timeout. An order captured before the restart is refused
    by the new router as a replay."""
    original = str(ROOT / "models" / "tiny-llama")
    v = client.update_weights(original)
    if v < 2:  # (so that the router's first number, 1, would be a number the fleet knows)
        v = client.update_weights(original)
    old_id = client.status()["router_id"]
    # An order seen on the wire before the restart (security/nonce_journal.py): replayed to the new
    # router below, it is refused, as it was by the old one
    captured = client.router.signer.sign("set_trace", {"on": False})
    client.router.handle.set_trace.remote(captured).result(timeout_s=60)
    kill_router()
    deadline = time.monotonic() + 300
    while True:  # the driver's call as soon as any router answers, before the replicas pull from it
        try:
            again = client.update_weights(original, timeout_s=120)
            break
        except Exception as e:  # the killed router under the call (its status, or the order)
            assert time.monotonic() < deadline and "WeightsNotLearned" not in type(e).__name__, e
            time.sleep(0.1)
    st = client.status()
    assert st["router_id"] != old_id and again > v, (again, v)
    with pytest.raises(Exception, match="replay"):
        client.router.handle.set_trace.remote(captured).result(timeout_s=60)
    assert client.status()["control"]["refused"].get("replay") == 1
    assert st["weights"]["version"] == again and set(st["weights"]["replicas"].values()) == {again}


def test_a_router_restarted_after_a_scale_expects_the_scaled_fleet(client):
    """Regression (h-route9): a restarted router expected the config's replica count, not the size
    scale() had set: it waited a replica timeout for a replica scaled away (or, after a scale-up,
    took the fleet as heard before every replica reported). It reads Serve's live target."""
    st = client.scale(1, timeout_s=300)
    assert len(st["replicas"]) == 1 and st["expected_replicas"] == 1
    try:
        old_id = st["router_id"]
        kill_router()
        deadline = time.monotonic() + 300
        while True:
            try:
                st = client.status()
                if st["router_id"] != old_id:
                    break
            except Exception:  # the killed one, under the call
                pass
            assert time.monotonic() < deadline, "no new router"
            time.sleep(0.2)
        # at once, not a replica timeout later (the config says 2)
        assert st["expected_replicas"] == 1, st["expected_replicas"]
    finally:
        st = client.scale(2, timeout_s=600)  # the other tests' fleet
    assert len(st["replicas"]) == 2 and st["expected_replicas"] == 2
