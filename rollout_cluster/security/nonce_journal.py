"""The nonces a router accepted, kept where the router that Serve starts after it finds them.

OrderVerifier (signing.py) refuses a nonce it saw within the skew window, but it keeps them in its
process: a router that Serve restarted (a crash, a killed actor) knew none of them, so an order
captured on the wire in the last `max_clock_skew_s` before the restart ran once more. The journal
writes each accepted nonce to a key-value store that outlives the router (Ray's GCS: the
`GcsKV` adapter) before the order runs; the next router reads back those still inside the window
(`recall`) and hands them to its verifier (`OrderVerifier.remember`).

Plain state over an injected store: one key per nonce, `<issued_ms>:<nonce>`, so a restart lists
them without reading values, and keys the window left behind are deleted as new ones are written.
"""
from __future__ import annotations

import re
import threading
from typing import Callable, Optional, Protocol


class KV(Protocol):
    """The store: what Ray's internal KV (GcsKV below) offers, within one namespace."""

    def put(self, key: str) -> None: ...
    def keys(self) -> list[str]: ...
    def delete(self, key: str) -> None: ...


class NonceJournal:
    """The accepted nonces of one app's routers. `window_ms`: how long an order's nonce must be
    remembered (the verifier's: orders issued further back are refused for skew anyway)."""

    def __init__(self, kv: KV, window_ms: int, warn: Optional[Callable[[str], None]] = None):
        self.kv = kv  # the store shared by this app's router incarnations
        self.window_ms = window_ms  # a nonce older than this (from its order's issued_ms) is dropped
        self.written: dict[str, int] = {}  # key -> issued_ms: the keys this journal knows still live
        self.warn = warn or (lambda message: None)  # how a store that fails is said (accepted)
        self._lock = threading.Lock()  # accepted() may run in several threads at once (Serve's router)

    def accepted(self, nonce: str, issued_ms: int) -> None:
        """Journal an order the verifier accepted, before it runs. A store that fails is said
        (`warn`), not raised: the order still runs; only a replay across the next restart is no
        longer refused."""
        try:
            with self._lock:
                # (its issued_ms for the clock: the router's is within the skew of it, and the window is twice that)
                self.record(nonce, issued_ms, issued_ms)
        except Exception as e:  # noqa: BLE001 (the store, not this router, is at fault)
            self.warn(f"control orders: nonce not journaled ({type(e).__name__}: {e}); the order runs, "
                      f"and would run again if replayed to the router Serve starts after this one")

    def recall(self, now_ms: int) -> dict[str, int]:
        """The nonces (-> issued_ms) accepted within the window by any router before this one;
        the keys older than the window are deleted."""
        out = {}
        for key in self.kv.keys():
            issued, nonce = _parse(key)
            if issued is None:
                continue  # (not ours: left alone)
            if issued < now_ms - self.window_ms:
                self.kv.delete(key)
            else:
                out[nonce] = issued
                self.written[key] = issued
        return out

    def record(self, nonce: str, issued_ms: int, now_ms: int) -> None:
        """Write one accepted nonce (before its order runs); delete the keys the window left."""
        key = f"{issued_ms}:{nonce}"
        self.kv.put(key)
        self.written[key] = issued_ms
        floor = now_ms - self.window_ms
        for old in [k for k, t in self.written.items() if t < floor]:
            self.kv.delete(old)
            del self.written[old]


_KEY = re.compile(r"([0-9]{1,20}):(\S+)")  # "<issued_ms>:<nonce>", ASCII digits only ("²".isdigit() is True)


def _parse(key: str):
    m = _KEY.fullmatch(key)
    return (int(m.group(1)), m.group(2)) if m else (None, None)


class GcsKV:
    """Ray's internal key-value store (the GCS, which outlives every actor), in one namespace."""

    def __init__(self, namespace: str):
        from ray.experimental import internal_kv
        self._kv, self.namespace = internal_kv, namespace

    def put(self, key: str) -> None:
        self._kv._internal_kv_put(key.encode(), b"", overwrite=True, namespace=self.namespace)

    def keys(self) -> list[str]:
        return [k.decode() for k in self._kv._internal_kv_list(b"", namespace=self.namespace)]

    def delete(self, key: str) -> None:
        self._kv._internal_kv_del(key.encode(), namespace=self.namespace)


def attach(verifier, kv: KV, now_ms: int, warn, hook: bool = True) -> NonceJournal:
    """A router's verifier made to remember its predecessors' nonces, and a journal of its own:
    `journal.accepted(nonce, issued_ms)` writes one (thread-safe; the Serve router calls it in a
    thread, `hook=False`), or with `hook` the verifier calls it as it accepts each order.
    `warn(message)`: a store that fails is said, not fatal (the orders still run; only a replay
    across the next restart is no longer refused)."""
    journal = NonceJournal(kv, int(2 * verifier.max_skew_s * 1000), warn)
    try:
        verifier.remember(journal.recall(now_ms))
    except Exception as e:  # noqa: BLE001 (the store, not this router, is at fault)
        warn(f"control orders: the nonces of the router before this one could not be read "
             f"({type(e).__name__}: {e}); one replayed from before the restart is not refused")
    if hook:
        verifier.on_accept = journal.accepted
    return journal
