"""Replay across a router restart (security/nonce_journal.py): the nonces a router accepted are
written to a store that outlives it, and the router Serve starts after it refuses them too. The
store here is a dict; tests/e2e/test_router_killed.py replays a captured order to a restarted
router over Ray's GCS."""
import pytest

from rollout_cluster.security.nonce_journal import NonceJournal, attach
from rollout_cluster.security.signing import OrderRefused, OrderVerifier, Signer

KEYS = {"k1": b"s" * 32}
SKEW = 30.0


class DictKV:
    def __init__(self):
        self.data, self.fail = set(), False

    def put(self, key):
        if self.fail:
            raise ConnectionError("GCS unreachable")
        self.data.add(key)

    def keys(self):
        if self.fail:
            raise ConnectionError("GCS unreachable")
        return sorted(self.data)

    def delete(self, key):
        self.data.discard(key)


def router(kv, now_s, warnings=None):
    """A router incarnation's verifier, journaled in `kv` (as serve/router.py makes it)."""
    v = OrderVerifier(dict(KEYS), SKEW)
    attach(v, kv, int(now_s * 1000), (warnings if warnings is not None else []).append)
    return v


def signed(op, args, at_s):
    return Signer(dict(KEYS), clock=lambda: at_s).sign(op, args)


def test_an_order_captured_before_a_restart_is_refused_by_the_next_router():
    kv = DictKV()
    first = router(kv, 1000.0)
    order = signed("set_trace", {"on": True}, 1000.0)
    assert first.check(order, "set_trace", 1000.5) == {"on": True}
    with pytest.raises(OrderRefused) as e:
        first.check(order, "set_trace", 1001.0)
    assert e.value.reason == "replay"
    second = router(kv, 1010.0)  # Serve started it 10 s later: the order is well inside the skew
    with pytest.raises(OrderRefused) as e:
        second.check(order, "set_trace", 1010.0)
    assert e.value.reason == "replay" and second.refusals["replay"] == 1
    fresh = signed("set_trace", {"on": True}, 1010.0)  # a new order of the same call runs
    assert second.check(fresh, "set_trace", 1010.0) == {"on": True}
    third = router(kv, 1020.0)  # both routers' nonces reach the one after them
    for o in (order, fresh):
        with pytest.raises(OrderRefused):
            third.check(o, "set_trace", 1020.0)


def test_the_store_keeps_only_the_window_and_a_restart_cleans_what_it_left():
    kv = DictKV()
    v = router(kv, 1000.0)
    for t in (1000.0, 1010.0, 1020.0):
        v.check(signed("wake", {}, t), "wake", t)
    assert len(kv.data) == 3
    v.check(signed("wake", {}, 1071.0), "wake", 1071.0)  # over 2 x SKEW after 1000 and 1010: gone
    assert sorted(int(k.split(":")[0]) for k in kv.data) == [1020000, 1071000]
    kv.data.add("900000:" + "a" * 32)  # left by a router that died long ago
    kv.data.add("not-a-nonce")  # someone else's key in the namespace: left alone
    journal = NonceJournal(kv, int(2 * SKEW * 1000))
    recalled = journal.recall(1075000)
    assert sorted(recalled.values()) == [1020000, 1071000]
    assert "900000:" + "a" * 32 not in kv.data and "not-a-nonce" in kv.data


def test_an_order_just_inside_the_skew_is_remembered_as_long_as_it_could_be_replayed():
    """The window is the verifier's: an order issued SKEW ahead of the router's clock is accepted
    for 2 x SKEW of router time; a restart anywhere in that span still refuses its replay."""
    kv = DictKV()
    order = signed("wake", {}, 1030.0)
    router(kv, 1000.0).check(order, "wake", 1000.0)  # issued 30 s ahead: accepted
    for t in (1000.0, 1030.0, 1059.0):
        with pytest.raises(OrderRefused) as e:
            router(kv, t).check(order, "wake", t)
        assert e.value.reason == "replay", t
    with pytest.raises(OrderRefused) as e:
        router(kv, 1061.0).check(order, "wake", 1061.0)
    assert e.value.reason == "skew"  # (past the window: the clock refuses it, not the journal)


def test_a_store_that_fails_is_said_and_the_orders_still_run():
    kv, warnings = DictKV(), []
    kv.fail = True
    v = router(kv, 1000.0, warnings)
    assert "could not be read" in warnings[0] and "ConnectionError" in warnings[0]
    assert v.check(signed("wake", {}, 1000.0), "wake", 1000.0) == {}
    assert "not journaled" in warnings[1] and v.accepted == 1
    kv.fail = False
    v.check(signed("wake", {}, 1001.0), "wake", 1001.0)
    assert len(kv.data) == 1 and len(warnings) == 2
