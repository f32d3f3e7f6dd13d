"""Signed control orders: every operation that changes the fleet carries an HMAC-SHA256 signature.

A SignedOrder names its operation and arguments, when it was issued, a nonce and the key that
signed it. The router (OrderVerifier) refuses an order that is unsigned, malformed, for another
operation, signed by an unknown key or with a bad signature, issued too far from its clock, or
replayed, and counts each refusal by reason. Pure: the clock is an argument, nothing is logged.

The signature covers `canonical(...)`: compact JSON of [op, args, issued_ms, nonce, key_id] with
sorted keys, so any signer (Python or not) can produce it; an order bound to an app (`app`, as
every signer here binds it) signs [op, args, issued_ms, nonce, key_id, app], and a router of
another app refuses it (apps that share keys: one .secrets/ per config folder, one k8s Secret).
"""
from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

# Each operation and the names of its arguments, in the order the Router's methods take them.
CONTROL_OPS: dict[str, tuple[str, ...]] = {
    "update_weights": ("path", "version", "running"),
    # push_weights: the object ids of the buckets sent beside the order (signed here, so that no
    # one can swap the tensors), their tensor and byte counts, and the push's name ("push://<id>")
    # `objects`: how many objects (the manifest and every bucket) a streamed push has in all
    "push_weights": ("source", "version", "buckets", "tensors", "bytes", "running", "objects"),
    # push_more: the push's later buckets (sent while the replicas load the first ones), from the
    # object at `start` on, with their object ids
    "push_more": ("source", "start", "buckets"),
    # push_abort: the trainer failed before the streamed push's last objects: the fleet goes back
    "push_abort": ("source", "reason"),
    "sleep": ("level",),
    "wake": (),
    "set_fleet_target": ("replicas",),
    "set_policy": ("policy",),
    "set_trace": ("on",),
    "cancel": ("batch_id",),
    "register": ("replica_id", "incarnation"),  # a replica asks for its report credential
}
REASONS = ("unsigned", "malformed", "wrong_op", "wrong_app", "unknown_key", "bad_signature", "skew", "replay")
NONCE = re.compile(r"[0-9a-f]{32}")
_DUMMY_KEY = b"\0" * 32  # an unknown key id still costs one HMAC: no timing tells it apart


class OrderRefused(PermissionError):
    """A control order the router will not run; `reason` is one of REASONS."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"control order refused ({reason}): {message}")
        self.reason = reason


@dataclass(frozen=True)
class SignedOrder:
    """One control operation, as a caller sends it to the router."""

    op: str  # the operation (a key of CONTROL_OPS)
    args: dict  # its arguments by name: what the router runs is exactly what was signed
    issued_ms: int  # the signer's wall clock (Unix milliseconds) when it signed
    nonce: str  # 128 random bits, hex: the router accepts each nonce once
    key_id: str = ""  # the key that signed ("" with `signature`: unsigned)
    signature: str = ""  # hex HMAC-SHA256 of canonical(op, args, issued_ms, nonce, key_id, app)
    app: str = ""  # the Serve app it is for ("": any app whose router holds the key)


def canonical(op: str, args: dict, issued_ms: int, nonce: str, key_id: str, app: str = "") -> bytes:
    fields = [op, args, issued_ms, nonce, key_id] + ([app] if app else [])
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False, ensure_ascii=True).encode()


def _mac(key: bytes, order: SignedOrder) -> str:
    return hmac.new(key, canonical(order.op, order.args, order.issued_ms, order.nonce, order.key_id, order.app),
                    hashlib.sha256).hexdigest()


def bind_args(op: str, args: tuple, kwargs: dict) -> dict:
    """A call's positional and keyword arguments by name (CONTROL_OPS[op]); TypeError on extras."""
    names = CONTROL_OPS[op]
    if len(args) > len(names):
        raise TypeError(f"{op}: takes at most {len(names)} arguments ({', '.join(names)})")
    out = dict(zip(names, args))
    for k, v in kwargs.items():
        if k not in names or k in out:
            raise TypeError(f"{op}: unexpected or repeated argument {k!r}")
        out[k] = v
    return out


class Signer:
    """Signs control orders with the first configured key; with no key, makes unsigned orders
    (which only a router configured with security.allow_unsigned_control accepts)."""

    def __init__(self, keys: Optional[dict] = None, clock=time.time, app: str = ""):
        self.key_id, self.key = next(iter((keys or {}).items()), ("", b""))
        self.clock = clock
        self.app = app  # the app its orders are bound to ("": none)

    def sign(self, op: str, args: dict) -> SignedOrder:
        if op not in CONTROL_OPS:
            raise ValueError(f"op={op!r}: not a control operation ({', '.join(CONTROL_OPS)})")
        canonical(op, args, 0, "", "")  # args must be plain JSON: fail here, not at the router
        order = SignedOrder(op, args, int(self.clock() * 1000), secrets.token_hex(16), self.key_id, app=self.app)
        if not self.key:
            return order
        return SignedOrder(order.op, order.args, order.issued_ms, order.nonce, order.key_id, _mac(self.key, order),
                           self.app)


@dataclass
class OrderVerifier:
    """The router's check of each control order. `keys` {key_id: key}: up to two verify
    (rotation); none and `allow_unsigned`: unsigned orders pass (development only)."""

    keys: dict
    max_skew_s: float = 30.0
    allow_unsigned: bool = False
    app: str = ""  # this router's app: an order bound to another is refused (wrong_app)
    refusals: Counter = field(default_factory=Counter)  # reason -> orders refused
    accepted: int = 0  # orders that passed
    _nonces: dict = field(default_factory=dict)  # nonce -> issued_ms, while within the skew window
    # Called with (nonce, issued_ms) of each order that passed, before it runs: the router writes it
    # where the router Serve starts after it reads it back (nonce_journal.py; remember()).
    on_accept: Optional[Callable[[str, int], None]] = None

    def __post_init__(self):
        if not self.keys and not self.allow_unsigned:
            raise ValueError("no control key configured (security.control_keys_file or $ROLLOUT_CONTROL_KEYS); "
                             "set security.allow_unsigned_control: true to run without one (development only)")

    def check(self, order, op: str, now_s: float) -> dict:
        """The arguments of `order` if it may run as `op` now (wall clock `now_s`); else OrderRefused."""
        try:
            args = self._check(order, op, now_s)
        except OrderRefused as e:
            self.refusals[e.reason] += 1
            raise
        self.accepted += 1
        return args

    def _check(self, order, op: str, now_s: float) -> dict:
        if not isinstance(order, SignedOrder):
            raise OrderRefused("unsigned", f"{op} needs a SignedOrder (security/signing.py), got {type(order).__name__}")
        bad = _malformed(order)
        if bad:
            raise OrderRefused("malformed", bad)
        if order.op != op:
            raise OrderRefused("wrong_op", f"signed for {order.op[:40]!r}, sent as {op!r}")
        if order.app and self.app and order.app != self.app:
            raise OrderRefused("wrong_app", f"signed for app {order.app[:64]!r}, sent to app {self.app!r}")
        for name, value in order.args.items():
            try:
                canonical(order.op, {name: value}, order.issued_ms, order.nonce, order.key_id)
            except (TypeError, ValueError) as e:
                raise OrderRefused("malformed", f"args[{_short(name)}]={_short(value)}: not plain JSON ({e})") from None
        try:  # (the names together: sort_keys needs them of one type)
            canonical(order.op, order.args, order.issued_ms, order.nonce, order.key_id)
        except (TypeError, ValueError) as e:
            raise OrderRefused("malformed", f"args={_short(order.args)}: not plain JSON ({e})") from None
        if self.keys or order.signature or order.key_id:
            key = self.keys.get(order.key_id)
            # (as bytes: compare_digest raises TypeError on a str with non-ASCII characters, a forgery's)
            good = hmac.compare_digest(_mac(key or _DUMMY_KEY, order).encode(),
                                       order.signature.encode("utf-8", "surrogatepass"))
            if key is None:
                raise OrderRefused("unknown_key" if order.key_id else "unsigned",
                                   f"key_id={order.key_id[:64]!r} is not a configured key")
            if not good:
                raise OrderRefused("bad_signature", "the signature does not match the order")
        skew = abs(now_s * 1000 - order.issued_ms) / 1000
        if skew > self.max_skew_s:
            raise OrderRefused("skew", f"issued {skew:.3f} s from the router's clock (more than "
                                       f"security.max_clock_skew_s={self.max_skew_s:g})")
        self._forget_old(now_s)
        if order.nonce in self._nonces:
            raise OrderRefused("replay", "this nonce was used already")
        self._nonces[order.nonce] = order.issued_ms
        if self.on_accept is not None:
            self.on_accept(order.nonce, order.issued_ms)
        return dict(order.args)

    def remember(self, nonces: dict) -> None:
        """Nonces (-> issued_ms) a predecessor accepted: refused as replays here too."""
        self._nonces.update(nonces)
        self._nonces = dict(sorted(self._nonces.items(), key=lambda kv: kv[1]))  # (oldest first: _forget_old)

    def _forget_old(self, now_s: float) -> None:
        """Drop nonces whose orders fall outside the window (those are refused for skew anyway)."""
        floor = (now_s - 2 * self.max_skew_s) * 1000
        if self._nonces and next(iter(self._nonces.values())) < floor:
            self._nonces = {n: t for n, t in self._nonces.items() if t >= floor}


def _short(value, limit: int = 64) -> str:
    """repr(value), cut to `limit` characters (a refusal names what came, never a whole payload)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _malformed(order: "SignedOrder") -> str:
    """The first field of `order` whose type or form is wrong, with its value ("" when none is)."""
    checks = (("op", isinstance(order.op, str), "a string"), ("args", isinstance(order.args, dict), "a dict"),
              ("issued_ms", type(order.issued_ms) is int, "an int (Unix milliseconds)"),
              ("nonce", isinstance(order.nonce, str) and bool(NONCE.fullmatch(order.nonce)), "32 lowercase hex digits"),
              ("key_id", isinstance(order.key_id, str), "a string"),
              ("signature", isinstance(order.signature, str), "a string"),
              ("app", isinstance(order.app, str), "a string"))
    for name, ok, want in checks:
        if not ok:
            return f"{name}={_short(getattr(order, name))}: must be {want}"
    return ""
