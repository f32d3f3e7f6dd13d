"""push_weights on the real cluster (2 vLLM-CPU replicas): a trainer's tensors reach both replicas
through Ray's object store without a checkpoint, and the greedy outputs equal those of the same
weights loaded from a checkpoint; a push while long sequences run (running="recompute") continues
them exactly: old weights' tokens up to the swap, then the new weights' greedy continuation. The
weights digest (RolloutClient.weights_digest) shows both replicas holding the same bits, and a push
holding exactly what the same tensors loaded from a checkpoint hold. Status shows how each replica's
worker got the buckets: on Linux every push between batches is read where it lies in the object
store (no silent fallback to /dev/shm slots), a keep swap stages files."""
import json
import subprocess
import time

import pytest
import torch

from rollout_cluster.model_maker import make_model
from rollout_cluster.protocol import SamplingSpec

from e2e_support import ROOT, VENV_BIN, ray_env

pytestmark = pytest.mark.e2e

GREEDY = SamplingSpec(n=2, max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9, 10] * 5, [11, 12, 13] * 7]


def state_dict(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32).state_dict()


def all_from_the_store(st: dict) -> None:
    """Every replica's last load had the worker read each bucket where it lies in Ray's object store."""
    handed = st["handed"]
    assert set(handed) == set(st["replicas"]) and len(handed) == 2, handed
    for rid, h in handed.items():
        assert h["store"] >= 1 and h["slot"] == 0 and sum(h.values()) == h["store"], (rid, handed)


def greedy(client, prompts=PROMPTS, spec=GREEDY):
    out = client.generate(prompts, spec, timeout_s=600)
    seen = {}
    for c in out:
        assert c.finish_reason == "length" and len(c.token_ids) == spec.max_tokens
        seen.setdefault(c.prompt_index, set()).add(tuple(c.token_ids))
    assert all(len(v) == 1 for v in seen.values()), seen  # both samples (and replicas) agree
    return [next(iter(seen[i])) for i in range(len(prompts))], out


def generate_behind(client, prompts, spec, tokens: int):
    """generate(prompts, spec) in a thread; returns (thread, results) once the fleet has made
    `tokens` more tokens (at most 300 s), so that a weights update lands mid-batch."""
    import threading
    import time

    results: dict = {}
    made = client.status()["counters"]["generated_tokens"]
    runner = threading.Thread(target=lambda: results.update(out=client.generate(prompts, spec, timeout_s=900)))
    runner.start()
    deadline = time.monotonic() + 300
    while client.status()["counters"]["generated_tokens"] < made + tokens and time.monotonic() < deadline:
        time.sleep(0.2)
    return runner, results


def test_pushed_tensors_serve_exactly_as_the_checkpoint_and_in_flight_pushes_continue_exactly(client, tmp_path):
    original = ROOT / "models" / "tiny-llama"
    other = make_model(str(tmp_path / "b"), seed=1)
    base, _ = greedy(client)
    try:
        # unstreamed (every bucket in before the order); the rest: the default, streamed (the later
        # buckets in push_more calls)
        v1 = client.push_weights(state_dict(other).items(), bucket_bytes=1 << 20, stream=False)  # several buckets
        st = client.status()["weights"]
        assert set(st["replicas"].values()) == {v1} and st["path"].startswith("push://")
        all_from_the_store(st)
        assert all(h["store"] >= 2 for h in st["handed"].values())  # several buckets, each from the store
        pushed, out = greedy(client)
        assert {c.weights_version for c in out} == {v1} and len({c.replicas[0] for c in out}) == 2
        assert pushed != base
        v2 = client.update_weights(str(other))
        assert greedy(client)[0] == pushed  # the same tensors from a checkpoint: the same tokens

        # In flight: long sequences on the checkpoint's weights, the original model pushed meanwhile.
        long = SamplingSpec(n=1, max_tokens=400, temperature=0.0, ignore_eos=True)
        reference = [list(c.token_ids) for c in client.generate(PROMPTS, long, timeout_s=900)]  # all on v2
        runner, results = generate_behind(client, PROMPTS, long, 40)
        v3 = client.push_weights(state_dict(original).items(), running="recompute")
        runner.join(900)
        done = results["out"]
        assert [len(c.token_ids) for c in done] == [400, 400]
        for prompt, c in zip(PROMPTS, done):
            (start, first), (swap, second) = c.weight_versions  # one swap, recorded
            assert (start, first, second) == (0, v2, v3) and 0 < swap < 400 and c.weights_version == v3
            assert list(c.token_ids[:swap]) == reference[c.prompt_index][:swap]
            # the tokens before the swap are the checkpoint's greedy ones, those after the original's
            # greedy continuation of prompt + tokens so far (re-prefilled: exact)
            rest = client.generate([prompt + list(c.token_ids[:swap])],
                                   SamplingSpec(max_tokens=400 - swap, temperature=0.0, ignore_eos=True))[0]
            assert list(rest.token_ids) == list(c.token_ids[swap:])
        assert client.status()["counters"]["weights_recomputed"] >= 1
    finally:
        client.update_weights(str(original))  # the next tests expect the served model
    assert greedy(client)[0] == base


def test_keep_swaps_under_running_sequences_which_go_on_to_their_exact_length(client, tmp_path):
    """running="keep": the new weights go in between two engine steps; the running sequences keep
    their KV cache and length, their tokens up to the recorded swap are the old weights' greedy
    ones, and a request after the push is the new weights' alone (no old-weights cache block: the
    prompts are longer than vLLM-CPU's 128-token block, so their first block is cached)."""
    original = ROOT / "models" / "tiny-llama"
    other = make_model(str(tmp_path / "b"), seed=1)
    long = SamplingSpec(n=1, max_tokens=400, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9, 10] * 30, [11, 12, 13] * 50]  # 180 and 150 tokens
    base, _ = greedy(client)
    try:
        client.update_weights(str(other))
        after, _ = greedy(client, prompts)  # the other weights from a checkpoint, cache reset: what new requests give
        v_old = client.update_weights(str(original))
        reference = [list(c.token_ids) for c in client.generate(prompts, long, timeout_s=900)]  # old weights only
        kept = client.status()["counters"]["weights_kept"]
        runner, results = generate_behind(client, prompts, long, 40)
        v_new = client.push_weights(state_dict(other).items(), running="keep")
        runner.join(900)
        done = results["out"]
        assert sorted(c.prompt_index for c in done) == [0, 1] and [len(c.token_ids) for c in done] == [400, 400]
        swapped = 0
        for c in done:
            assert c.finish_reason == "length" and c.weight_versions[0] == (0, v_old) and c.migrations == []
            assert len(c.weight_versions) <= 2
            if len(c.weight_versions) == 2:  # the swap came before its end: recorded where
                swap, version = c.weight_versions[1]
                assert version == v_new and 0 < swap <= 400 and c.weights_version == v_new
                assert list(c.token_ids[:swap]) == reference[c.prompt_index][:swap]  # old weights up to the swap
                swapped += 1
        assert swapped >= 1 and client.status()["counters"]["weights_kept"] - kept == swapped
        handed = client.status()["weights"]["handed"]  # the swap staged each bucket as a file
        assert all(h["file"] >= 1 and sum(h.values()) == h["file"] for h in handed.values()), handed
        assert greedy(client, prompts)[0] == after  # the running ones' old-weights blocks are not reused
        # a push between batches after the swap: the replica's /dev/shm slots still reach the worker
        client.push_weights(state_dict(original).items())
        all_from_the_store(client.status()["weights"])
        assert greedy(client)[0] == base
    finally:
        client.update_weights(str(original))  # the next tests expect the served model
    assert greedy(client)[0] == base


def one_digest(answers: dict, version: int) -> dict:
    """The replicas' common per-parameter digests, after checking that both hold `version` and the same bits."""
    assert len(answers) == 2 and {a["version"] for a in answers.values()} == {version}, answers
    first, second = answers.values()
    assert first["digest"] == second["digest"] and first["params"] == second["params"]
    return first


def test_weights_digest_is_equal_across_replicas_and_a_push_holds_what_its_checkpoint_holds(client, tmp_path):
    """Both replicas hold the same bits after start; a push changes both alike; the same tensors
    from a checkpoint (update_weights) give the push's digest, parameter by parameter; and a reload of
    the served checkpoint gives the fresh engines' digest back. The push sends transposed views, which
the trainer copies through its reused staging buffer. (On vLLM-CPU a linear layer's weight
    lives in a oneDNN handle, not in its parameter: the digest covers embeddings, norms, biases.)"""
    original = ROOT / "models" / "tiny-llama"
    other = make_model(str(tmp_path / "b"), seed=1)
    v0 = client.status()["weights"]["version"]
    start = one_digest(client.weights_digest(detail=True), v0)
    assert "model.embed_tokens.weight" in start["params"]
    run = subprocess.run([str(VENV_BIN / "rollout-cluster"), "weights-digest", "--app-name", client.app_name],
                         env=ray_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    cli = json.loads(next(line for line in reversed(run.stdout.splitlines()) if line.startswith("{")))
    assert cli["identical"] and {r["digest"] for r in cli["replicas"].values()} == {start["digest"]}
    try:
        # every matrix pushed as a transposed view (not contiguous): copied through the trainer's
        # reused staging buffer (transfer/staging.py), bucket after bucket, and still the same bits
        strided = [(k, v.t().contiguous().t() if v.dim() == 2 else v) for k, v in state_dict(other).items()]
        assert sum(not v.is_contiguous() for _, v in strided) >= 10
        v1 = client.push_weights(strided, bucket_bytes=1 << 20)
        pushed = one_digest(client.weights_digest(detail=True), v1)
        assert pushed["digest"] != start["digest"]
        assert pushed["params"]["model.embed_tokens.weight"] != start["params"]["model.embed_tokens.weight"]
        v2 = client.update_weights(str(other))
        loaded = one_digest(client.weights_digest(detail=True), v2)
        assert loaded["params"] == pushed["params"] and loaded["digest"] == pushed["digest"]
    finally:
        v3 = client.update_weights(str(original))  # the next tests expect the served model
    assert one_digest(client.weights_digest(detail=True), v3)["params"] == start["params"]


def store_bytes() -> int:
    """Bytes in use in this node's Ray object store (the node's raylet's own count)."""
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    return get_memory_info_reply(get_state_from_address()).store_stats.object_store_bytes_used


def settles(check, timeout_s: float = 20.0) -> int:
    """The store's bytes in use once `check(bytes)` holds (Ray frees objects asynchronously), or the
    last count after `timeout_s`."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        used = store_bytes()
        if check(used) or time.monotonic() > deadline:
            return used
        time.sleep(0.5)


def test_repeated_pushes_keep_one_version_in_the_object_store(client):
    """The fleet keeps the buckets of the version it holds (a joiner and a deep sleeper's wake load
    them) and lets every replaced version's go: after three pushes the store holds one version's
    bytes, not three (or two: an H200 host's store filled on a 7B model's third push that way);
    a checkpoint update lets the last push go too."""
    original = ROOT / "models" / "tiny-llama"
    sd = state_dict(original)
    size = sum(t.numel() * t.element_size() for t in sd.values())
    client.update_weights(str(original))
    base = settles(lambda used: False, timeout_s=2.0)
    try:
        for k in range(3):
            client.push_weights([(n, t * (1.0 + 0.01 * k)) for n, t in sd.items()], bucket_bytes=1 << 20)
        used = settles(lambda used: used - base < 1.5 * size)
        assert 0.5 * size < used - base < 1.5 * size, (used - base, size)  # the current version's, once
    finally:
        client.update_weights(str(original))  # the next tests expect the served model
    used = settles(lambda used: used - base < 0.5 * size)
    assert used - base < 0.5 * size, (used - base, size)


class Held:
    """The fleet before a push that will be aborted: the served checkpoint loaded again (`v0`), its
    greedy tokens, digest and replicas, and another model to push (`other`)."""

    def __init__(self, client, tmp_path):
        self.original = ROOT / "models" / "tiny-llama"
        self.other = make_model(str(tmp_path / "b"), seed=1)
        self.v0 = client.update_weights(str(self.original))
        self.base, _ = greedy(client)
        self.digest = one_digest(client.weights_digest(detail=True), self.v0)
        self.replicas = set(client.status()["weights"]["replicas"])

    def back(self, client, aborted: dict) -> None:
        """After the abort: the same replicas hold v0 again, bit for bit (none restarted), each says
        how its load of the push ended, and the next push loads, numbered above the aborted one."""
        assert greedy(client)[0] == self.base  # (it waits until a replica holds v0 and loads nothing)
        assert one_digest(client.weights_digest(detail=True), self.v0)["params"] == self.digest["params"]
        st = client.status()["weights"]
        assert set(st["aborted"]["replicas"]) == self.replicas, st["aborted"]
        assert set(st["replicas"]) == self.replicas  # the same replicas: none restarted
        v2 = client.push_weights(state_dict(self.other).items(), bucket_bytes=1 << 19)
        assert v2 > aborted["version"] and greedy(client)[0] != self.base


def test_a_streamed_push_its_trainer_aborts_sends_the_fleet_back_without_a_restart(client, tmp_path, monkeypatch):
    """The trainer fails between its streamed push's order and its last bucket (the fourth
    bucket's put raises, once the replicas have loaded the first ones): push_weights raises the
    trainer's own error at once and tells the router (push_abort); the fleet goes back to the
    version before; each replica's load stops at once and, its engine's weights being a mix,
    reloads the checkpoint it held. No replica restarts, every parameter is the old one again
    (digest), the greedy tokens are the old weights', and the next push loads."""
    import time

    from rollout_cluster.transfer import push as push_mod

    held = Held(client, tmp_path)
    v0 = held.v0
    real_put = push_mod._put

    def failing_put(group, i, stage, bucket_bytes):
        if i == 3:
            time.sleep(3.0)  # the replicas load buckets 0 and 1 meanwhile: their engines' weights become a mix
            raise MemoryError("pinned memory exhausted (a test's)")
        return real_put(group, i, stage, bucket_bytes)

    monkeypatch.setattr(push_mod, "_put", failing_put)
    try:
        t0 = time.monotonic()
        with pytest.raises(MemoryError, match="a test's"):
            client.push_weights(state_dict(held.other).items(), bucket_bytes=1 << 19, stream=True)  # 7 buckets
        assert time.monotonic() - t0 < 30  # not the replicas' 60 s wait for a next bucket
        st = client.status()["weights"]
        assert st["version"] == v0 and st["aborted"]["back_to"] == v0 and st["aborted"]["version"] > v0
        assert "MemoryError: pinned memory exhausted" in st["aborted"]["reason"]
        monkeypatch.setattr(push_mod, "_put", real_put)
        greedy(client)  # (it waits until a replica holds v0 and loads nothing)
        ended = client.status()["weights"]["aborted"]["replicas"]  # each replica's load: stopped, then reloaded
        assert all(f"reloaded version {v0} from" in e for e in ended.values()), ended
        held.back(client, st["aborted"])
    finally:
        client.update_weights(str(held.original))  # the next tests expect the served model
    assert greedy(client)[0] == held.base


DYING_TRAINER = """
import os, sys, time
import torch
from transformers import AutoModelForCausalLM
from rollout_cluster.client.client import RolloutClient
from rollout_cluster.transfer import push as push_mod

client = RolloutClient.connect(sys.argv[1])
named = AutoModelForCausalLM.from_pretrained(sys.argv[2], torch_dtype=torch.float32).state_dict()
real_put = push_mod._put

def dying_put(group, i, stage, bucket_bytes):
    if i == 3:  # the order and buckets 0-2 went out: the replicas load them meanwhile
        time.sleep(3.0)
        print("dying", flush=True)
        os._exit(9)  # no push_abort, no ray.shutdown: as a trainer the kernel killed
    return real_put(group, i, stage, bucket_bytes)

push_mod._put = dying_put
client.push_weights(named.items(), bucket_bytes=1 << 19)  # 7 buckets, streamed (the default)
print("the push came whole", flush=True)
"""


def test_a_streamed_push_whose_trainer_dies_is_aborted_by_the_router_within_seconds(client, tmp_path):
    """The trainer's process dies between its streamed push's order and its last bucket, telling
    nobody (os._exit in another Ray driver). Its lease (transfer/lease.py) dies with it; the router,
    which pings it while the push comes (serve/push_watch.py), aborts the push within seconds, not
    the replicas' 60 s wait for a next bucket: the fleet goes back to the weights it held, every
    parameter is the old one again (digest), no replica restarts, and the next push loads."""
    import time

    held = Held(client, tmp_path)
    v0 = held.v0
    script = tmp_path / "dying_trainer.py"
    script.write_text(DYING_TRAINER)
    try:
        run = subprocess.run([str(VENV_BIN / "python"), str(script), client.app_name, str(held.other)], env=ray_env(),
                             capture_output=True, text=True, timeout=600, cwd=ROOT)
        died_t = time.monotonic()
        assert run.returncode == 9 and "dying" in run.stdout, (run.returncode, run.stdout, run.stderr[-3000:])
        while time.monotonic() - died_t < 60:
            st = client.status()["weights"]
            if st["aborted"] and st["aborted"]["version"] > v0:
                break
            time.sleep(0.2)
        aborted_s = time.monotonic() - died_t
        print(f"the router aborted the dead trainer's push {aborted_s:.2f} s after the trainer's process ended")
        assert st["aborted"] and st["aborted"]["version"] > v0, st
        assert aborted_s < 20, aborted_s  # the watch's ping, not bucket_stream.STALL_S (60 s)
        assert st["version"] == v0 and st["aborted"]["back_to"] == v0 and not st["streaming"]
        assert "the trainer's process died before the push's last objects came" in st["aborted"]["reason"], st
        held.back(client, st["aborted"])
    finally:
        client.update_weights(str(held.original))  # the next tests expect the served model
    assert greedy(client)[0] == held.base


def killed(lease) -> None:
    """ray.kill the lease and wait until Ray says it died: the kill is sent, not done, when ray.kill
    returns, and a ping right after it may still be answered (what CI saw, under load). A lease
    found dead is what the trainer meets after Ray's memory monitor killed it, seconds before."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    ray.kill(lease)
    deadline = time.monotonic() + 60
    while True:
        try:
            ray.get(lease.alive.remote(), timeout=10)
        except GetTimeoutError:
            pass
        except RayActorError as e:
            if "unavailable" not in type(e).__name__.lower():
                return
        assert time.monotonic() < deadline, "a killed lease still answers after 60 s"
        time.sleep(0.1)


def test_a_lease_killed_while_its_trainer_lives_is_replaced_and_the_push_goes_on(client):
    """The trainer's lease dies while the trainer lives (Ray's memory monitor, a ray.kill): the next
    push pings it first, makes a new one, and its streamed push is not aborted as a dead trainer's."""
    import ray

    from rollout_cluster.transfer.lease import lease_of_this_process

    original = ROOT / "models" / "tiny-llama"
    lease = lease_of_this_process()
    assert ray.get(lease.alive.remote(), timeout=120) is True
    assert lease_of_this_process() is lease  # (alive: kept)
    killed(lease)
    new = lease_of_this_process()
    assert new is not None and new is not lease and ray.get(new.alive.remote(), timeout=120) is True
    killed(new)  # (the push itself replaces it now)
    before = client.status()["weights"]["aborted"]
    v = client.push_weights(state_dict(original).items(), bucket_bytes=1 << 19)  # 7 buckets, streamed
    st = client.status()["weights"]
    assert st["version"] == v and set(st["replicas"].values()) == {v} and st["aborted"] == before, st
    client.update_weights(str(original))  # (the next tests expect the checkpoint)
