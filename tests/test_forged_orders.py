"""Drill: 1,000 forged, replayed, expired and wrongly-keyed control orders; all refused, each
counted by reason.

The real Router deployment's class runs in-process (no Ray), verifying with two keys (a rotation
under way). Its methods get 1,000 bad orders, spread over the eight control operations
(update_weights, sleep, wake, set_fleet_target, set_policy, set_trace, cancel, register) and
these forgeries: not an order at all; unsigned, or unsigned with a signature; malformed (issued_ms
a float, a string or a bool; a nonce short, upper-case or not hex; args not a mapping or not plain
JSON; op or key_id not a string; a signature of bytes; a signed register naming no replica); signed
for another operation; one bit flipped in each field (op: wrong_op; key_id: unknown_key; args,
issued_ms, nonce, signature: bad_signature), an argument added; signed by an unknown key, a retired
key, or this deployment's key id with another deployment's secret; issued too long ago or too far
ahead (max_clock_skew_s); and valid orders replayed. Every one must raise OrderRefused with its
reason, change nothing (weights, sleep, fleet target, policy, trace, credentials, batches and
sequences cancelled, orders waiting for the replica), and count one refusal of that reason, in
status()["control"] and in rollout_control_refusals_total. A valid order goes between every four
forged ones (signed by either key) and must run. Half the forged orders meet a batch running on the
replica, half an idle fleet (where valid updates, sleeps and policy swaps run). No refusal, log
line or status shows a key's secret.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections import Counter
from dataclasses import replace

import pytest

from rollout_cluster.config import ClusterConfig, to_dict
from rollout_cluster.protocol import (EngineStats, ModelInfo, Report, SamplingSpec, SeqProgress, SequenceRequest,
                                      WeightsState)
from rollout_cluster.security.signing import CONTROL_OPS, REASONS, OrderRefused, OrderVerifier, SignedOrder, Signer

FORGED = 1000
VALID_EVERY = 4  # a valid order after every 4 forged ones
SKEW_S = 300.0  # security.max_clock_skew_s: a slow CI machine still replays within the nonce window
SECRET_NEW, SECRET_OLD = "n3w-" + "5e1c7a0d" * 5, "0ld-" + "b4d9e2f6" * 5  # the deployment's keys
OTHER_SECRET = "0th3r-" + "a1b2c3d4" * 5  # another deployment's, under this one's key id
KEYS = {"drill-new": SECRET_NEW.encode(), "drill-old": SECRET_OLD.encode()}
METHODS = tuple(CONTROL_OPS)
FORGERIES = {  # the reason each is refused for -> the forgeries that meet it
    "unsigned": ("not_an_order", "unsigned", "unsigned_with_signature"),
    "malformed": ("issued_float", "issued_str", "issued_bool", "nonce_short", "nonce_upper", "nonce_not_hex",
                  "args_not_mapping", "args_not_json", "op_not_str", "key_id_not_str", "signature_bytes",
                  "register_no_replica"),
    "wrong_op": ("wrong_op", "flip_op"),
    "wrong_app": ("other_app", "flip_app"),
    "unknown_key": ("unknown_key", "retired_key", "flip_key_id"),
    "bad_signature": ("flip_args", "flip_issued", "flip_nonce", "flip_signature", "arg_added", "other_deployment"),
    "skew": ("expired", "future"),
    "replay": ("replay",),
}


def sign(op: str, args: dict, key_id: str = "drill-new", secret: bytes = SECRET_NEW.encode(), shift_s: float = 0.0,
         app: str = ""):
    return Signer({key_id: secret}, clock=lambda: time.time() + shift_s, app=app).sign(op, args)


def flip_hex(s: str, rng: random.Random) -> str:
    i = rng.randrange(len(s))
    return s[:i] + format(int(s[i], 16) ^ (1 << rng.randrange(4)), "x") + s[i + 1:]


def flip_str(s: str, rng: random.Random) -> str:
    i = rng.randrange(len(s))
    return s[:i] + chr(ord(s[i]) ^ (1 << rng.randrange(7))) + s[i + 1:]


def flip_value(v, rng: random.Random):
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v ^ (1 << rng.randrange(8))
    if isinstance(v, str):
        return flip_str(v, rng)
    if isinstance(v, list):  # (push_weights' bucket ids)
        return [flip_value(x, rng) for x in v]
    return {k: flip_value(x, rng) for k, x in v.items()}  # (set_policy's mapping)


class Drill:
    def __init__(self, router, tmp_path, rng: random.Random):
        self.router, self.tmp_path, self.rng = router, tmp_path, rng
        self.expected = Counter()  # reason -> forged orders refused for it
        self.by_forgery = Counter()  # forgery -> how many went
        self.accepted = 0  # orders whose signature held
        self.pool: dict = {op: [] for op in METHODS}  # op -> valid orders it ran (to replay)
        self.messages: list = []  # every refusal's text
        self.version, self.n = 0, 0
        self.target_batch = ""  # the batch forged cancels aim at

    # ---- the state a forged order must not change -------------------------------------------------
    def state(self) -> dict:
        r, c = self.router, self.router.core
        return {"weights": (c.weights.version, c.weights.path), "sleep": c.sleep.level, "target": c.fleet.expected,
                "policy": (id(c.policy), r.cfg.policy.model_dump_json()), "trace": c.trace is not None,
                "credentials": dict(r.credentials),
                "batches_cancelled": {bid: b.cancelled for bid, b in c.batches.live.items()},
                "seqs": {s.seq_id: (s.status, s.cancelled) for s in c.seqs.values()},
                "outbox": {rid: (repr(o.control), list(o.give_up)) for rid, o in c.outbox.orders.items()}}

    def refused(self) -> Counter:
        return Counter(self.router.verifier.refusals)

    def metric(self, reason: str) -> float:
        return self.router.metrics.registry.get_sample_value("rollout_control_refusals_total", {"reason": reason}) or 0

    # ---- orders ---------------------------------------------------------------------------------------
    def args(self, op: str) -> dict:
        """Valid arguments of `op` now."""
        self.n += 1
        return {"update_weights": {"path": str(self.tmp_path / f"step-{self.version + 1}"), "version": self.version + 1},
                "sleep": {"level": 1}, "wake": {}, "set_fleet_target": {"replicas": 1 + self.n % 3},
                "set_policy": {"policy": {"name": "pull"}}, "set_trace": {"on": self.n % 2 == 0},
                "cancel": {"batch_id": self.target_batch}, "register": {"replica_id": f"r{self.n}", "incarnation": "i"},
                "push_weights": {"source": f"push://d{self.n}", "version": self.version + 1,
                                 "buckets": [f"{self.n:032x}"], "tensors": 1, "bytes": 4},
                # (the later buckets of the push the fleet is at)
                "push_more": {"source": self.router.core.weights.path,
                              "start": len(self.router.core.weights.buckets or ()), "buckets": [f"{self.n:032x}"]},
                # (a push whose objects all came: nothing to abort, the answer says so)
                "push_abort": {"source": f"push://d{self.n}", "reason": "drill"},
                }[op]

    async def call(self, op: str, order):
        if op in ("push_weights", "push_more"):  # the buckets travel beside the order: those the order names
            ids = order.args.get("buckets") if isinstance(getattr(order, "args", None), dict) else None
            return await getattr(self.router, op)(order, [BucketRef(h) for h in ids] if isinstance(ids, list) else [])
        return await getattr(self.router, op)(order)

    async def valid(self, op: str, args: dict) -> None:
        key_id = self.rng.choice(list(KEYS))
        order = sign(op, args, key_id, KEYS[key_id])
        await self.call(op, order)
        self.accepted += 1
        self.pool[op].append(order)
        if op in ("update_weights", "push_weights"):  # the replica loads it, so that the next update may follow
            self.version = args["version"]
            await pull(self.router, report())

    def forge(self, op: str, kind: str):
        """(a forged order for `op`, the method it goes to, the reason it must be refused for)."""
        rng, good = self.rng, sign(op, self.args(op))
        f = {"not_an_order": lambda: (rng.choice([None, dict(good.args), json.dumps(good.args), (op, good.args)]),
                                      "unsigned"),
             "unsigned": lambda: (Signer().sign(op, good.args), "unsigned"),
             "unsigned_with_signature": lambda: (replace(good, key_id=""), "unsigned"),
             "issued_float": lambda: (replace(good, issued_ms=good.issued_ms + 0.5), "malformed"),
             "issued_str": lambda: (replace(good, issued_ms=str(good.issued_ms)), "malformed"),
             "issued_bool": lambda: (replace(good, issued_ms=True), "malformed"),
             "nonce_short": lambda: (replace(good, nonce=good.nonce[:-1]), "malformed"),
             "nonce_upper": lambda: (replace(good, nonce=good.nonce.upper().replace("1", "A")), "malformed"),
             "nonce_not_hex": lambda: (replace(good, nonce="g" + good.nonce[1:]), "malformed"),
             "args_not_mapping": lambda: (replace(good, args=list(good.args.items())), "malformed"),
             "args_not_json": lambda: (replace(good, args={**good.args, "x": float("nan")}), "malformed"),
             "op_not_str": lambda: (replace(good, op=None), "malformed"),
             "key_id_not_str": lambda: (replace(good, key_id=7), "malformed"),
             "signature_bytes": lambda: (replace(good, signature=good.signature.encode()), "malformed"),
             "wrong_op": lambda: (sign(rng.choice([o for o in METHODS if o != op]), self.args(op)), "wrong_op"),
             "flip_op": lambda: (replace(good, op=flip_str(op, rng)), "wrong_op"),
             # the drill's router serves app "rollout"; another app's driver holds the same keys
             "other_app": lambda: (sign(op, good.args, app=f"app-{rng.randrange(10**6)}"), "wrong_app"),
             "flip_app": lambda: (replace(sign(op, good.args, app="rollout"), app="rollouT"), "wrong_app"),
             "flip_key_id": lambda: (replace(good, key_id=flip_str(good.key_id, rng)), "unknown_key"),
             "flip_args": lambda: (self._flip_args(good), "bad_signature"),
             "flip_issued": lambda: (replace(good, issued_ms=good.issued_ms ^ (1 << rng.randrange(12))), "bad_signature"),
             "flip_nonce": lambda: (replace(good, nonce=flip_hex(good.nonce, rng)), "bad_signature"),
             "flip_signature": lambda: (replace(good, signature=flip_hex(good.signature, rng)), "bad_signature"),
             "arg_added": lambda: (replace(good, args={**good.args, "admin": True}), "bad_signature"),
             "unknown_key": lambda: (sign(op, good.args, f"k{rng.randrange(10**6)}", rng.randbytes(32).hex().encode()),
                                     "unknown_key"),
             "retired_key": lambda: (sign(op, good.args, "drill-retired", b"r" * 40), "unknown_key"),
             "other_deployment": lambda: (sign(op, good.args, rng.choice(list(KEYS)), OTHER_SECRET.encode()),
                                          "bad_signature"),
             "expired": lambda: (sign(op, good.args, shift_s=-SKEW_S - rng.uniform(1, 86400)), "skew"),
             "future": lambda: (sign(op, good.args, shift_s=SKEW_S + rng.uniform(1, 86400)), "skew"),
             }
        if kind == "register_no_replica":  # signed, and the router's own check refuses it
            return sign("register", {"replica_id": rng.choice(["", 5, None]), "incarnation": "i"}), "register", "malformed"
        if kind == "replay":
            return rng.choice(self.pool[op]), op, "replay"
        order, reason = f[kind]()
        return order, op, reason

    def _flip_args(self, good: SignedOrder) -> SignedOrder:
        if not good.args:  # (wake takes none)
            return replace(good, args={"level": 1})
        args = dict(good.args)
        name = self.rng.choice(sorted(args))
        if self.rng.random() < 0.25:
            args[flip_str(name, self.rng)] = args.pop(name)
        else:
            args[name] = flip_value(args[name], self.rng)
        return replace(good, args=args)

    async def forged(self, op: str, kind: str) -> None:
        order, method, reason = self.forge(op, kind)
        before, counts, metric = self.state(), self.refused(), self.metric(reason)
        if reason == "malformed" and kind == "register_no_replica":
            self.accepted += 1  # its signature holds: the router refuses what it asks
        try:
            await self.call(method, order)
        except OrderRefused as e:
            refusal = e
        except Exception as e:
            raise AssertionError(f"{kind} order to {method}: not refused ({reason}), it ran: {e!r}") from e
        else:
            raise AssertionError(f"{kind} order to {method}: not refused ({reason}), it ran")
        assert refusal.reason == reason, (method, kind, order, str(refusal))
        self.by_forgery[kind] += 1
        assert self.state() == before, (method, kind)
        assert self.refused() - counts == Counter({reason: 1}) and self.metric(reason) == metric + 1, (method, kind)
        self.expected[reason] += 1
        self.messages.append(str(refusal))

    async def run(self, forged: int, start: int, valid_ops: tuple) -> None:
        """Forged orders `start`...: the i-th is refused for REASONS[i % 8], at every method in turn,
        each of that reason's forgeries in turn."""
        for i in range(start, start + forged):
            kinds, j = FORGERIES[REASONS[i % len(REASONS)]], i // len(REASONS)
            await self.forged(METHODS[j % len(METHODS)], kinds[(j // len(METHODS)) % len(kinds)])
            if (i + 1) % VALID_EVERY == 0:
                op = valid_ops[(i // VALID_EVERY) % len(valid_ops)]
                await self.valid(op, self.args(op))


class BucketRef:
    """An object-store handle as push_weights sends it: its id in hex."""

    def __init__(self, h):
        self.h = h

    def hex(self):
        return self.h


def report(rid: str = "a", progress=()) -> Report:
    return Report(rid, rid + "-1", progress=list(progress), stats=EngineStats(), model=ModelInfo(100, 64), capacity=4)


async def pull(router, rep: Report):
    """A replica's pull, with the credential it registered for, holding the weights it was told to."""
    rep.credential = router.credentials[rep.replica_id]
    rep.weights = WeightsState(version=router.core.weights.version, path=router.core.weights.path)
    return await router.pull(rep)


async def finished_batch(router, n: int, fetch: bool) -> str:
    """A batch of `n` that replica a runs to its end; fetched whole (and forgotten) if `fetch`."""
    bid = await router.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=4), i, 0) for i in range(n)],
                              wait_for_replica_s=1)
    works = (await pull(router, report())).start
    await pull(router, report(progress=[SeqProgress(w.seq_id, w.attempt, [5] * 4, None, "length", offset=0)
                                        for w in works]))
    if fetch:
        done, _, finished = await router.fetch(bid, 0, wait_s=1)
        assert finished and [c.finish_reason for c in done] == ["length"] * n
    return bid


async def drill(tmp_path, forged: int) -> tuple:
    """`forged` bad orders (half while a batch runs, half between batches) with valid ones between;
    returns the Drill and the router's status."""
    from rollout_cluster.serve.router import Router

    cfg = ClusterConfig(replicas=1, engine={"kind": "sim"}, router={"idle_pull_wait_s": 0.01},
                        security={"checkpoint_roots": [str(tmp_path)], "max_clock_skew_s": SKEW_S})
    router = Router.func_or_class(to_dict(cfg))
    d = Drill(router, tmp_path, random.Random(24))
    try:
        await d.valid("register", {"replica_id": "a", "incarnation": "a-1"})
        await pull(router, report())
        for op in METHODS:  # one valid order of each, to replay
            if op == "cancel":
                d.target_batch = await router.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=4), 0, 0)],
                                                     wait_for_replica_s=1)
            if op != "register":
                await d.valid(op, d.args(op))
        await d.valid("wake", {})
        # half of them while a batch runs on the replica
        running = await router.submit([SequenceRequest([1, 2], SamplingSpec(max_tokens=8), i, 0) for i in range(2)],
                                      wait_for_replica_s=1)
        works = (await pull(router, report())).start
        assert len(works) == 2
        d.target_batch = running
        await d.run(forged // 2, 0, ("set_trace", "set_fleet_target", "register", "wake"))
        assert [s.cancelled for s in router.core.seqs.values()] == [False, False]
        await pull(router, report(progress=[SeqProgress(w.seq_id, w.attempt, [5] * 8, None, "length", offset=0)
                                            for w in works]))
        done, _, finished = await router.fetch(running, 0, wait_s=1)
        assert finished and [c.finish_reason for c in done] == ["length", "length"]
        # ... and half between batches, aiming at one finished and not yet fetched
        d.target_batch = await finished_batch(router, 1, fetch=False)
        await d.run(forged - forged // 2, forged // 2, ("update_weights", "sleep", "wake", "set_policy", "set_trace",
                                                         "set_fleet_target", "register"))
        assert not router.core.batches[d.target_batch].cancelled
        return d, await router.status()
    finally:
        router._reaper.cancel()


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list = []

    def emit(self, record) -> None:
        self.lines.append(self.format(record))


def test_a_thousand_forged_orders_are_refused_and_counted_by_reason(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLOUT_CONTROL_KEYS", "; ".join(f"{k} {v.decode()}" for k, v in KEYS.items()))
    import rollout_cluster.serve.router  # noqa: F401 (importing Serve sets its logger up: add to it after)

    log, logged = logging.getLogger("ray.serve"), Lines()
    log.addHandler(logged)
    try:
        d, status = asyncio.run(drill(tmp_path, FORGED))
    finally:
        log.removeHandler(logged)
    counts = dict(sorted(d.expected.items()))
    print({"forged": sum(counts.values()), "by_reason": counts, "valid_accepted": d.accepted,
           "by_forgery": dict(d.by_forgery)})
    assert sum(d.expected.values()) == FORGED and set(d.by_forgery) == {k for v in FORGERIES.values() for k in v}
    assert max(d.expected.values()) - min(d.expected.values()) <= 1 and set(d.expected) == set(REASONS)
    assert status["control"] == {"accepted": d.accepted, "refused": counts}
    for reason in REASONS:
        assert d.metric(reason) == d.expected[reason], reason
    assert sum("control order refused" in line for line in logged.lines) == FORGED  # one line each
    shown = "\n".join(d.messages + logged.lines) + json.dumps(status, default=str)
    for secret in (SECRET_NEW, SECRET_OLD, OTHER_SECRET):
        assert secret not in shown and secret[:12] not in shown


def test_the_drill_catches_a_replay_let_through(tmp_path, monkeypatch):
    """The drill can fail: a verifier that forgets nonces at once lets the first replay run."""
    monkeypatch.setenv("ROLLOUT_CONTROL_KEYS", "; ".join(f"{k} {v.decode()}" for k, v in KEYS.items()))
    monkeypatch.setattr(OrderVerifier, "_forget_old", lambda self, now_s: self._nonces.clear())
    with pytest.raises(AssertionError, match=r"replay order to \w+: not refused \(replay\), it ran"):
        asyncio.run(drill(tmp_path, 2 * len(REASONS)))


def test_a_signed_register_naming_no_replica_is_refused_and_counted_as_malformed(tmp_path, monkeypatch):
    """Regression: Router.register raised OrderRefused("malformed") for a signed order whose
    replica_id is empty or not a string, but counted it nowhere (status()["control"]["refused"],
    rollout_control_refusals_total): every other refusal is counted by its reason."""
    monkeypatch.setenv("ROLLOUT_CONTROL_KEYS", "; ".join(f"{k} {v.decode()}" for k, v in KEYS.items()))

    async def go():
        from rollout_cluster.serve.router import Router

        router = Router.func_or_class(to_dict(ClusterConfig(replicas=1, engine={"kind": "sim"})))
        try:
            for rid in ("", 5, None):
                with pytest.raises(OrderRefused) as e:
                    await router.register(sign("register", {"replica_id": rid, "incarnation": "i"}))
                assert e.value.reason == "malformed"
            assert not router.credentials
            assert (await router.status())["control"] == {"accepted": 3, "refused": {"malformed": 3}}
            assert router.metrics.registry.get_sample_value("rollout_control_refusals_total",
                                                            {"reason": "malformed"}) == 3
        finally:
            router._reaper.cancel()

    asyncio.run(go())
