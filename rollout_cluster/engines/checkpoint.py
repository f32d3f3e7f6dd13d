"""A checkpoint is complete when its manifest says so: what a trainer writes last, and the check
every load goes through (docs/checkpoints.md).

The trainer writes its checkpoint (save_pretrained), then `rollout-manifest.json` LAST
(write_manifest, or `rollout-cluster write-manifest DIR`): the size of every other file, and
optionally its sha256. The manifest is written to a temporary name and renamed, so a reader sees
either no manifest or a whole one; a directory whose every listed file is there at its recorded
size was finished by its writer. A trainer that rewrites a directory removes the manifest first.

check_checkpoint refuses with a CheckpointError naming the file and the values:
- no such directory, or no config.json in it;
- no manifest while one is required (security.require_manifest), or a manifest of another format;
- a file the manifest lists missing, of another size, or (when it records one) of another sha256;
- config.json or a weight file the manifest does not list (written after it);
- a safetensors index naming a shard that is not there, or a .safetensors file shorter than its
  header declares (both checked with or without a manifest); no weight file at all.
Plain files and JSON only: the router checks a path before it orders the load, each engine again
before it loads.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Optional

MANIFEST = "rollout-manifest.json"
FORMAT = "rollout-manifest/1"
INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt")
MAX_SAFETENSORS_HEADER = 100 * 2**20  # safetensors' own bound on a header
PROBLEMS_SHOWN = 5


class CheckpointError(ValueError):
    """A checkpoint directory that is not complete; the message names the file and the values."""


def write_manifest(directory: str, sha256: bool = False) -> Path:
    """Seal a finished checkpoint: write `directory`/rollout-manifest.json listing every file but
    itself (hidden files aside) with its size, and its sha256 if asked. Call it last, once every
    file is written. Refuses (CheckpointError) a directory that is not a checkpoint yet: no
    config.json, an index naming a shard that is not there, a truncated .safetensors file."""
    root = Path(directory)
    _check_files(str(directory), root, None)
    files = _listing(root)
    body = {"format": FORMAT, "files": {rel: (root / rel).stat().st_size for rel in files}}
    if sha256:
        body["sha256"] = {rel: _sha256(root / rel) for rel in files}
    tmp = root / f".{MANIFEST}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / MANIFEST)  # atomic: a reader sees no manifest or the whole of it
    _fsync_dir(root)
    return root / MANIFEST


def check_checkpoint(path: str, require_manifest: bool = True, verify_sha256: bool = True) -> Optional[dict]:
    """Raise CheckpointError unless `path` is a complete checkpoint (module docstring); returns
    its manifest, or None when it has none (and none is required). `verify_sha256`: hash the
    files whose sha256 the manifest records (False: sizes only, for a quick check)."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint {path!r}: no such checkpoint directory on this node")
    if not (root / "config.json").is_file():
        raise CheckpointError(f"checkpoint {path!r}: no config.json (write the checkpoint with save_pretrained)")
    manifest = _read_manifest(path, root) if (root / MANIFEST).is_file() else None
    if manifest is None and require_manifest:
        raise CheckpointError(
            f"checkpoint {path!r}: no {MANIFEST}, and security.require_manifest is true: the trainer writes it "
            f"last, once every file is complete (engines.checkpoint.write_manifest, or `rollout-cluster "
            f"write-manifest DIR`; docs/checkpoints.md)")
    problems = []
    if manifest is not None:
        problems += _against_manifest(root, manifest, verify_sha256)
    _check_files(path, root, set(manifest["files"]) if manifest else None, problems)
    return manifest


def root_is_here(path: str, roots: list) -> bool:
    """Whether the checkpoint root holding `path` (resolved) is a directory on this node: where it
    is not (the router's pod does not mount the trainer's volume), the engines' own check decides."""
    real = os.path.realpath(path)
    for root in roots:
        top = os.path.realpath(root)
        if (real == top or real.startswith(top.rstrip(os.sep) + os.sep)) and os.path.isdir(top):
            return True
    return False


# ---- the parts ---------------------------------------------------------------------------------
def _listing(root: Path) -> list[str]:
    """Every file under `root` as a relative path with '/', but the manifest and hidden ones."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):  # (a linked folder is not entered: no cycles)
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if name == MANIFEST or name.startswith("."):
                continue
            out.append(Path(dirpath, name).relative_to(root).as_posix())
    return out


def _read_manifest(path: str, root: Path) -> dict:
    where = f"checkpoint {path!r}: {MANIFEST}"
    try:
        body = json.loads((root / MANIFEST).read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{where}: not JSON ({e})") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        found = body.get("format") if isinstance(body, dict) else body
        raise CheckpointError(f"{where}: format={found!r}, expected {FORMAT!r}")
    files, sums = body.get("files"), body.get("sha256", {})
    if not isinstance(files, dict) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                                              for v in files.values()):
        raise CheckpointError(f"{where}: files must map each relative path to its size in bytes")
    if not isinstance(sums, dict) or not all(isinstance(v, str) and len(v) == 64 for v in sums.values()):
        raise CheckpointError(f"{where}: sha256 must map relative paths to 64 hex digits")
    for rel in list(files) + list(sums):
        parts = Path(rel).parts
        if not rel or Path(rel).is_absolute() or ".." in parts:
            raise CheckpointError(f"{where}: {rel!r} is not a relative path inside the checkpoint")
    return body


def _against_manifest(root: Path, manifest: dict, verify_sha256: bool) -> list[str]:
    problems = []
    for rel, size in manifest["files"].items():
        f = root / rel
        if not f.is_file():
            problems.append(f"{rel}: missing ({MANIFEST} lists it at {size} bytes)")
            continue
        found = f.stat().st_size
        if found != size:
            problems.append(f"{rel}: expected {size} bytes ({MANIFEST}), found {found}")
    if verify_sha256 and not problems:  # (hashing a file of the wrong size says nothing new)
        for rel, digest in manifest.get("sha256", {}).items():
            found = _sha256(root / rel) if (root / rel).is_file() else "no file"
            if found != digest.lower():
                problems.append(f"{rel}: sha256 expected {digest} ({MANIFEST}), found {found}")
    return problems


def _check_files(path: str, root: Path, listed: Optional[set], problems: Optional[list] = None) -> None:
    """The checks that need no manifest (an index's shards, safetensors lengths, some weights),
    and, with a manifest (`listed`), that config.json and every weight file are in it."""
    problems = [] if problems is None else problems
    present = _listing(root)
    if not (root / "config.json").is_file():
        problems.append("config.json: missing (write the checkpoint with save_pretrained)")
    for index in INDEXES:
        if (root / index).is_file():
            try:
                shards = set(json.loads((root / index).read_text()).get("weight_map", {}).values())
            except (ValueError, AttributeError) as e:
                problems.append(f"{index}: not a JSON index ({e})")
                continue
            missing = sorted(s for s in shards if not (root / s).is_file())
            if missing:
                problems.append(f"{index} names shards that are not there: {missing[:PROBLEMS_SHOWN]}")
    weights = [rel for rel in present if rel.endswith(WEIGHT_SUFFIXES)]
    for rel in weights:
        if rel.endswith(".safetensors"):
            short = _safetensors_short(root / rel)
            if short:
                problems.append(f"{rel}: {short}")
    if not weights:
        problems.append(f"no weight files ({', '.join('*' + s for s in WEIGHT_SUFFIXES)})")
    if listed is not None:
        unlisted = [rel for rel in present if rel not in listed and (rel == "config.json" or rel in weights)]
        if unlisted:
            problems.append(f"{', '.join(unlisted[:PROBLEMS_SHOWN])}: not in {MANIFEST} (written after it?)")
    if problems:
        more = f" (and {len(problems) - PROBLEMS_SHOWN} more)" if len(problems) > PROBLEMS_SHOWN else ""
        raise CheckpointError(f"checkpoint {path!r} is incomplete: {'; '.join(problems[:PROBLEMS_SHOWN])}{more}")


def _safetensors_short(f: Path) -> Optional[str]:
    """Why a .safetensors file is cut short (its header declares more bytes than it has), or None.
    The header: 8 bytes of little-endian length, then JSON whose data_offsets end the file."""
    size = f.stat().st_size
    try:
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return f"truncated: {size} bytes, not even a safetensors header"
            (n,) = struct.unpack("<Q", head)
            if n > MAX_SAFETENSORS_HEADER or 8 + n > size:
                return f"truncated: its header says {n} header bytes, the file has {size} bytes"
            header = json.loads(fh.read(n))
    except (OSError, ValueError) as e:
        return f"unreadable safetensors header ({e})"
    if not isinstance(header, dict):
        return f"unreadable safetensors header (a JSON {type(header).__name__}, not an object)"
    ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__" and isinstance(t, dict)
            and isinstance(t.get("data_offsets"), list) and len(t["data_offsets"]) == 2]
    if not all(type(e) is int and e >= 0 for e in ends):
        return "unreadable safetensors header (a tensor's data_offsets are not byte counts)"
    expected = 8 + n + max(ends, default=0)
    if size != expected:
        return f"{'truncated' if size < expected else 'too long'}: its header declares {expected} bytes, found {size}"
    return None


def _sha256(f: Path) -> str:
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        for block in iter(lambda: fh.read(2**20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(root: Path) -> None:
    try:
        fd = os.open(root, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
