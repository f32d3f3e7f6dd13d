"""Secrets for a cluster a driver starts itself (RolloutClient.start, the demo, the Ray job).

A config that names no token and no control keys (and whose environment holds none) gets fresh
random ones, written once to <base_dir>/.secrets/ readable by their owner only, and the config
is pointed at those files; a config that names files that do not exist yet gets them created.
The Router, the Gateway and the replicas then read them as they would a mounted Kubernetes
Secret. An app deployed any other way (serve deploy, a RayService) gets nothing made for it: it
refuses to start without its secrets (docs/security.md).
"""
from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path
from typing import Optional

from ..config import ClusterConfig
from .secrets import new_token, read_keys, read_token, write_private

log = logging.getLogger(__name__)
SECRETS_DIR = ".secrets"


def _not_private(path: str, mask: int, what: str) -> Optional[str]:
    """Why `path` is not this user's alone (None: it is): a link, another user's, or `mask` bits set."""
    st = os.lstat(path)
    return ("is a link" if stat.S_ISLNK(st.st_mode) else
            f"belongs to uid {st.st_uid}, not {os.getuid()}" if hasattr(os, "getuid") and st.st_uid != os.getuid() else
            f"{what} (mode {stat.S_IMODE(st.st_mode):04o})" if st.st_mode & mask else None)


def check_private_dir(folder: str) -> None:
    """Refuse to make secrets in a folder another user could change: one that is a link, is not
    this user's, or that its group or others may write (they could swap the token for their own
    before the cluster reads it)."""
    why = _not_private(folder, 0o022, "is writable by its group or others")
    if why:
        raise PermissionError(f"{folder} {why}: another user could replace the secrets made there; make it this "
                              "user's with mode 0700, or set base_dir elsewhere")


def check_private_file(path: str) -> None:
    """Refuse a secret file another user made or could read or change: a link, not this user's, or
    with any permission for its group or others."""
    why = _not_private(path, 0o077, "may be used by its group or others")
    if why:
        raise PermissionError(f"{path} {why}: not used as a secret; remove it (a new one is made) or make it this "
                              "user's with mode 0600")


def ensure_local_secrets(cfg: ClusterConfig) -> list[str]:
    """Point `cfg.security` at secret files, making those that are missing; returns the files made."""
    sec = cfg.security
    folder = Path(cfg.base_dir or os.getcwd()) / SECRETS_DIR
    made, update = [], {}
    if not sec.token_file and read_token(sec) is None and not sec.allow_unauthenticated:
        update["token_file"] = str(folder / "token")
    if not sec.control_keys_file and not read_keys(sec) and not sec.allow_unsigned_control:
        update["control_keys_file"] = str(folder / "control-keys")
    if update:
        sec = sec.model_copy(update=update)  # (the config is pointed at them once they pass: below)
    for path, make in ((sec.token_file, new_token),
                       (sec.control_keys_file, lambda: f"local-{secrets.token_hex(4)} {secrets.token_hex(32)}\n")):
        if path and not os.path.exists(path):
            os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
            check_private_dir(os.path.dirname(path) or ".")
            write_private(path, make() if make is not new_token else make() + "\n")
            made.append(path)
        elif path and Path(path).parent == folder:  # made here before: used only where nobody else could have
            check_private_dir(str(folder))
            check_private_file(path)
    cfg.security = sec
    for path in made:
        log.info("made the secret file %s (readable by its owner only)", path)
    return made
