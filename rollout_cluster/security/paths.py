"""Where update_weights may load from: under one of security.checkpoint_roots, after realpath."""
from __future__ import annotations

import os


class PathRefused(PermissionError):
    """An update_weights path outside every checkpoint root."""


def check_under_roots(path, roots: list) -> str:
    """`path` resolved (symlinks and '..' followed), if it lies under one of `roots` (resolved
    too); else PathRefused naming the path and the roots."""
    if not isinstance(path, str) or not path or "\0" in path:
        raise PathRefused(f"path={path!r}: must be a non-empty path string")
    if not roots:
        raise PathRefused(f"path={path!r}: no checkpoint roots are configured (security.checkpoint_roots), "
                          "so no weights may be loaded; list the folders trainers write checkpoints under")
    real = os.path.realpath(path)
    for root in roots:
        top = os.path.realpath(root)
        if real == top or real.startswith(top.rstrip(os.sep) + os.sep):
            return real
    raise PathRefused(f"path={path!r} (resolved: {real!r}) is not under any of security.checkpoint_roots={roots!r}")
