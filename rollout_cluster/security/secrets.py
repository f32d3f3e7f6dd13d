"""Reading the HTTP token and the control keys from where SecurityConfig says they are.

A secret never travels in the config (Serve's `args`, a RayService's serveConfigV2): the config
names a file (a mounted Kubernetes Secret) or an environment variable, and each process reads it.
Errors name the file or the variable and what is wrong, never the secret itself.
"""
from __future__ import annotations

import os
import re
from typing import Optional

MIN_TOKEN_CHARS = 16  # a shorter token is refused: guessable
MIN_KEY_CHARS = 32  # an HMAC key shorter than this is refused
MAX_KEYS = 2  # the signing key and the one it replaces, while a rotation is under way
KEY_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")
TOKEN_CHARS = re.compile(r"[!-~]+")  # printable ASCII, no space


class SecretError(ValueError):
    """A configured secret is missing or malformed (the message names where, never the secret)."""


def _read(file: str, env: str, what: str) -> tuple[Optional[str], str]:
    """(text, where it came from): the file, else the file $<env>_FILE names, else $<env>; text
    None when none is set."""
    if file:
        try:
            with open(file, encoding="utf-8") as f:
                return f.read(), f"file {file!r}"
        except (OSError, UnicodeDecodeError) as e:
            raise SecretError(f"{what}: cannot read file {file!r}: {type(e).__name__}") from None
    if env and os.environ.get(env + "_FILE"):  # the variable names a file (as Docker's secrets do)
        return _read(os.environ[env + "_FILE"], "", f"${env}_FILE")
    text = os.environ.get(env) if env else None
    return (text, f"environment variable {env}") if text else (None, "")


def read_token(security) -> Optional[str]:
    """The HTTP bearer token (security.token_file, else $security.token_env), or None."""
    text, where = _read(security.token_file, security.token_env, "security.token_file")
    if text is None:
        return None
    token = text.strip()
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise SecretError(f"the token in {where} must be one word of at least {MIN_TOKEN_CHARS} characters")
    if not TOKEN_CHARS.fullmatch(token):  # (HTTP headers reach the Gateway decoded as latin-1: no other could match)
        raise SecretError(f"the token in {where} must be printable ASCII (a byte-order mark or another character "
                          "no `Authorization: Bearer` header can carry as it is)")
    return token


def read_keys(security) -> dict[str, bytes]:
    """The control keys {key_id: key}, signing key first; {} when none is configured.
    One `key_id secret` a line (or `;`-separated in the variable); '#' at a line's start or after
    a space starts a comment (one inside a secret is refused: it would have cut the key short)."""
    text, where = _read(security.control_keys_file, security.control_keys_env, "security.control_keys_file")
    if text is None:
        return {}
    keys: dict[str, bytes] = {}
    for n, line in enumerate(re.split(r"[;\n]", text), 1):
        line = re.split(r"(?:^|\s)#", line, maxsplit=1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if "#" in line:
            raise SecretError(f"{where}, entry {n}: '#' inside a key id or secret (a comment starts at a line's "
                              "start or after a space)")
        if len(parts) != 2 or not KEY_ID.fullmatch(parts[0]):
            raise SecretError(f"{where}, entry {n}: must be `key_id secret` (key_id: letters, digits, _ . -)")
        kid, secret = parts
        # (by entry number, never the key id: written in the wrong order, a hex secret passes for one)
        if len(secret) < MIN_KEY_CHARS:
            raise SecretError(f"{where}, entry {n}: the secret must be at least {MIN_KEY_CHARS} characters "
                              "(is the line `key_id secret`, in that order?)")
        if kid in keys:
            raise SecretError(f"{where}, entry {n}: its key id was given twice (in an earlier entry too)")
        keys[kid] = secret.encode()
    if not keys:
        raise SecretError(f"{where} holds no key")
    if len(keys) > MAX_KEYS:
        raise SecretError(f"{where} holds {len(keys)} keys: at most {MAX_KEYS} (the signing key and the one it replaces)")
    return keys


def new_token() -> str:
    """A fresh random token (the demo writes one; `rollout-cluster secrets` prints one)."""
    import secrets

    return secrets.token_urlsafe(32)


def write_private(path: str, text: str) -> None:
    """Write `text` to a new file `path`, readable by its owner only (0600 from the start). A path
    that exists, a link even if it dangles, is refused: a secret is never written through a link
    someone else planted."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
    except FileExistsError:
        raise PermissionError(f"{path}: exists (a link, or a file made meanwhile); a secret is only written "
                              "to a new file: remove it, or name the secret in the config") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.chmod(path, 0o600)
