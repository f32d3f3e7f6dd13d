"""A checkpoint loads only when complete (engines/checkpoint.py, docs/checkpoints.md): each way a
directory can be incomplete is refused with a CheckpointError naming the file and the values,
by check_checkpoint and by the Router before it orders a load."""
import asyncio
import json
import os
import struct

import pytest

from rollout_cluster.cli import main
from rollout_cluster.config import ClusterConfig, to_dict
from rollout_cluster.engines.checkpoint import (FORMAT, MANIFEST, CheckpointError, check_checkpoint, root_is_here,
                                                write_manifest)
from rollout_cluster.protocol import EngineStats, InputError, LoadWeights, ModelInfo, Report
from router_support import order, pull


def safetensors(tensors: dict) -> bytes:
    """A .safetensors file of float32 tensors {name: element count}, as the library writes it."""
    header, offset = {}, 0
    for name, n in tensors.items():
        header[name] = {"dtype": "F32", "shape": [n], "data_offsets": [offset, offset + 4 * n]}
        offset += 4 * n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + bytes(offset)


def checkpoint(folder, shards: int = 2, manifest: bool = True, sha256: bool = False):
    """A sharded save_pretrained-like checkpoint: config.json, an index, `shards` shards."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 16}))
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        (folder / name).write_bytes(safetensors({f"layer{i}.w": 8 + i}))
        weight_map[f"layer{i}.w"] = name
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if manifest:
        write_manifest(str(folder), sha256=sha256)
    return folder


SHARD = "model-00002-of-00002.safetensors"


def test_a_sealed_checkpoint_passes_and_its_manifest_lists_every_file_but_itself(tmp_path):
    ckpt = checkpoint(tmp_path / "step-1")
    body = json.loads((ckpt / MANIFEST).read_text())
    assert body["format"] == FORMAT == "rollout-manifest/1" and "sha256" not in body
    assert body["files"] == {f: (ckpt / f).stat().st_size for f in os.listdir(ckpt) if f != MANIFEST}
    assert check_checkpoint(str(ckpt)) == body
    assert [f for f in os.listdir(ckpt) if "tmp" in f] == []  # written to a temporary name, then renamed


def test_no_directory_or_no_config_json_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint directory"):
        check_checkpoint(str(tmp_path / "nowhere"))
    ckpt = checkpoint(tmp_path / "step-1")
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"step-1'?: no config.json"):
        check_checkpoint(str(ckpt))


def test_a_missing_manifest_is_refused_when_required_and_allowed_when_not(tmp_path):
    ckpt = checkpoint(tmp_path / "step-1", manifest=False)
    with pytest.raises(CheckpointError, match=rf"no {MANIFEST}, and security.require_manifest is true.*write-manifest"):
        check_checkpoint(str(ckpt), require_manifest=True)
    assert check_checkpoint(str(ckpt), require_manifest=False) is None


def test_a_file_the_manifest_lists_missing_or_of_another_size_is_named_with_both_sizes(tmp_path):
    ckpt = checkpoint(tmp_path / "step-1")
    size = (ckpt / SHARD).stat().st_size
    with open(ckpt / SHARD, "r+b") as f:  # a shard still being written
        f.truncate(size - 12)
    with pytest.raises(CheckpointError, match=rf"{SHARD}: expected {size} bytes \({MANIFEST}\), found {size - 12}"):
        check_checkpoint(str(ckpt))
    (ckpt / SHARD).unlink()
    with pytest.raises(CheckpointError, match=rf"{SHARD}: missing \({MANIFEST} lists it at {size} bytes\)"):
        check_checkpoint(str(ckpt))


def test_a_sha256_that_differs_is_named_and_sizes_alone_do_not_see_it(tmp_path):
    ckpt = checkpoint(tmp_path / "step-1", sha256=True)
    want = json.loads((ckpt / MANIFEST).read_text())["sha256"][SHARD]
    data = bytearray((ckpt / SHARD).read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    (ckpt / SHARD).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{SHARD}: sha256 expected {want} \({MANIFEST}\), found [0-9a-f]{{64}}"):
        check_checkpoint(str(ckpt))
    check_checkpoint(str(ckpt), verify_sha256=False)  # the router's quick check: sizes only


def test_an_index_naming_an_absent_shard_is_refused_even_without_a_manifest(tmp_path):
    ckpt = checkpoint(tmp_path / "step-1", manifest=False)
    (ckpt / SHARD).unlink()
    why = rf"model.safetensors.index.json names shards that are not there: \['{SHARD}'\]"
    with pytest.raises(CheckpointError, match=why):
        check_checkpoint(str(ckpt), require_manifest=False)


def test_a_truncated_safetensors_file_is_refused_without_a_manifest(tmp_path):
    ckpt = checkpoint(tmp_path / "step-1", manifest=False)
    full = (ckpt / SHARD).stat().st_size
    with open(ckpt / SHARD, "r+b") as f:
        f.truncate(full - 4)
    why = rf"{SHARD}: truncated: its header declares {full} bytes, found {full - 4}"
    with pytest.raises(CheckpointError, match=why):
        check_checkpoint(str(ckpt), require_manifest=False)
    (ckpt / SHARD).write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match=rf"{SHARD}: truncated: 2 bytes, not even a safetensors header"):
        check_checkpoint(str(ckpt), require_manifest=False)


def test_a_weight_file_written_after_the_manifest_is_refused(tmp_path):
    ckpt = checkpoint(tmp_path / "step-1")
    (ckpt / "extra.safetensors").write_bytes(safetensors({"x": 2}))
    with pytest.raises(CheckpointError, match=rf"extra.safetensors: not in {MANIFEST} \(written after it\?\)"):
        check_checkpoint(str(ckpt))


def test_a_manifest_of_another_format_or_naming_paths_outside_is_refused(tmp_path):
    ckpt = checkpoint(tmp_path / "step-1")
    (ckpt / MANIFEST).write_text(json.dumps({"format": "other/2", "files": {}}))
    with pytest.raises(CheckpointError, match=rf"{MANIFEST}: format='other/2', expected '{FORMAT}'"):
        check_checkpoint(str(ckpt))
    (ckpt / MANIFEST).write_text(json.dumps({"format": FORMAT, "files": {"../secret": 3}}))
    with pytest.raises(CheckpointError, match=r"'\.\./secret' is not a relative path inside the checkpoint"):
        check_checkpoint(str(ckpt))
    (ckpt / MANIFEST).write_text('{"format": ')
    with pytest.raises(CheckpointError, match=rf"{MANIFEST}: not JSON"):
        check_checkpoint(str(ckpt))


def test_write_manifest_refuses_to_seal_an_incomplete_checkpoint(tmp_path):
    ckpt = checkpoint(tmp_path / "step-1", manifest=False)
    (ckpt / SHARD).unlink()
    with pytest.raises(CheckpointError, match=f"names shards that are not there: \\['{SHARD}'\\]"):
        write_manifest(str(ckpt))
    assert not (ckpt / MANIFEST).exists()


def test_the_command_line_writes_the_manifest_with_sha256(tmp_path, capsys):
    ckpt = checkpoint(tmp_path / "step-1", manifest=False)
    assert main(["write-manifest", str(ckpt), "--sha256"]) == 0
    body = json.loads((ckpt / MANIFEST).read_text())
    assert set(body["sha256"]) == set(body["files"]) and len(body["files"]) == 4
    assert "4 files" in capsys.readouterr().out and check_checkpoint(str(ckpt))


# ---- the Router checks the path before it orders a load ----------------------------------------
def _router(tmp_path, **security):
    from rollout_cluster.serve.router import Router

    cfg = ClusterConfig(replicas=1, engine={"kind": "vllm", "model": "m"},
                        security={"checkpoint_roots": [str(tmp_path)], **security})
    return Router.func_or_class(to_dict(cfg))


def _report(rid="a"):
    return Report(rid, rid + "-1", stats=EngineStats(), model=ModelInfo(100, 64), capacity=4)


def test_the_router_refuses_an_incomplete_checkpoint_before_ordering_it(tmp_path):
    async def go():
        router = _router(tmp_path)
        try:
            await pull(router, _report())
            torn = checkpoint(tmp_path / "torn")
            with open(torn / SHARD, "r+b") as f:
                f.truncate(10)
            unsealed = checkpoint(tmp_path / "unsealed", manifest=False)
            for path, why in ((torn, f"{SHARD}: expected \\d+ bytes \\({MANIFEST}\\), found 10"),
                              (unsealed, f"no {MANIFEST}"), (tmp_path / "typo", "no such checkpoint directory")):
                with pytest.raises(CheckpointError, match=why):
                    await router.update_weights(order("update_weights", path=str(path)))
            assert router.core.weights.version == 0 and not router.core.outbox.get("a")  # nothing ordered
            good = checkpoint(tmp_path / "good")
            assert await router.update_weights(order("update_weights", path=str(good))) == 1
            assert (await pull(router, _report())).control == [LoadWeights(str(good.resolve()), 1)]
        finally:
            router._reaper.cancel()

    asyncio.run(go())


def test_without_require_manifest_the_router_still_checks_the_shards(tmp_path):
    async def go():
        router = _router(tmp_path, require_manifest=False)
        try:
            await pull(router, _report())
            unsealed = checkpoint(tmp_path / "unsealed", manifest=False)
            assert await router.update_weights(order("update_weights", path=str(unsealed))) == 1
            (unsealed / SHARD).unlink()
            with pytest.raises(CheckpointError, match="names shards that are not there"):
                await router.update_weights(order("update_weights", path=str(unsealed), version=2))
        finally:
            router._reaper.cancel()

    asyncio.run(go())


def test_a_root_this_node_does_not_mount_leaves_the_check_to_the_engines(tmp_path):
    assert root_is_here(str(tmp_path / "step-1"), [str(tmp_path)])
    assert not root_is_here("/no-such-volume/step-1", ["/no-such-volume"])
    assert not root_is_here(str(tmp_path / "step-1"), ["/no-such-volume"])


def test_the_router_refuses_a_path_that_broke_a_load(tmp_path):
    async def go():
        router = _router(tmp_path)
        try:
            await pull(router, _report())
            good = checkpoint(tmp_path / "good")
            await router.update_weights(order("update_weights", path=str(good)))
            from rollout_cluster.protocol import WeightsState

            failed = _report()
            failed.weights = WeightsState(version=0, error="replica a: load_weights: CUDA error", error_version=1)
            await pull(router, failed)
            why = r"its load as version 1 failed on replica a \(replica a: load_weights: CUDA error\); a broken"
            with pytest.raises(InputError, match=why):
                await router.update_weights(order("update_weights", path=str(good)))
            st = await router.status()
            assert st["weights"]["broken"] == [{"path": str(good.resolve()), "version": 1, "replica": "a",
                                                "error": "replica a: load_weights: CUDA error"}]
        finally:
            router._reaper.cancel()

    asyncio.run(go())
