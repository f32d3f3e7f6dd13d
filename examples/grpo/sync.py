"""Weight sync from the trainer to the engines, two ways, each timed.

- push: `client.push_weights(named parameters)`: the tensors go through Ray's object store to
  every replica, which loads them in place; no file in between.
- checkpoint: save_pretrained into a fresh directory under one of the config's
  security.checkpoint_roots, seal it with its manifest (write_manifest, written last), then
  `client.update_weights(path)`: every replica reloads from disk.
"""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

MODES = ("push", "checkpoint")


@dataclass
class SyncTiming:
    version: int  # the weights version the engines hold afterwards
    total_s: float  # the whole sync, as the trainer waits for it
    save_s: float = 0.0  # checkpoint: save_pretrained + manifest (0 for push)
    load_s: float = 0.0  # checkpoint: update_weights until every replica holds it; push: push_weights


def write_manifest_if_known(directory: Path) -> bool:
    """Seal the checkpoint (its manifest, written last); False on a rollout_cluster without manifests."""
    try:
        from rollout_cluster.engines.checkpoint import write_manifest
    except ImportError:
        return False
    write_manifest(str(directory))
    return True


class WeightSync:
    """Syncs the policy's weights to the engines; `mode` is one of MODES."""

    def __init__(self, client, mode: str, checkpoint_dir: Path, keep: int = 2):
        if mode not in MODES:
            raise ValueError(f"--sync={mode!r}: choose one of {', '.join(MODES)}")
        if mode == "push" and not hasattr(client, "push_weights"):
            raise RuntimeError("--sync push: this rollout_cluster's RolloutClient has no push_weights; "
                               "use --sync checkpoint")
        self.client = client
        self.mode = mode
        self.checkpoint_dir = Path(checkpoint_dir)
        self.keep = keep  # checkpoints kept on disk: the engines' current one and the one before
        self.saved: list[Path] = []
        self.count = 0

    def __call__(self, model) -> SyncTiming:
        return self.push(model) if self.mode == "push" else self.checkpoint(model)

    def checkpoint(self, model) -> SyncTiming:
        t0 = time.perf_counter()
        self.count += 1
        path = self.checkpoint_dir / f"sync-{self.count:05d}"
        if path.exists():
            shutil.rmtree(path)  # a rerun into the same folder: never load a half-old directory
        model.save_pretrained(path, safe_serialization=True)
        write_manifest_if_known(path)
        t1 = time.perf_counter()
        version = self.client.update_weights(str(path))
        t2 = time.perf_counter()
        self.saved.append(path)
        while len(self.saved) > self.keep:
            shutil.rmtree(self.saved.pop(0), ignore_errors=True)
        return SyncTiming(version=version, total_s=t2 - t0, save_s=t1 - t0, load_s=t2 - t1)

    def push(self, model) -> SyncTiming:
        if not hasattr(self.client, "push_weights"):
            raise RuntimeError("push_weights: not on this RolloutClient; use --sync checkpoint")
        t0 = time.perf_counter()
        version = self.client.push_weights((name, p.detach()) for name, p in model.named_parameters())
        t1 = time.perf_counter()
        return SyncTiming(version=int(version), total_s=t1 - t0, load_s=t1 - t0)


def compare(client, model, checkpoint_dir: Path, repeats: int) -> dict:
    """Both ways on the same weights, alternating, `repeats` times each: {mode: [SyncTiming, ...]}.
    Push is left out (and said so) where the client has no push_weights."""
    out = {"push": [] if hasattr(client, "push_weights") else None, "checkpoint": []}
    syncs = {m: WeightSync(client, m, checkpoint_dir / "compare") for m in MODES if out[m] is not None}
    for _ in range(repeats):
        for mode, sync in syncs.items():
            out[mode].append(sync(model))
    return out
