"""A driver's fleet call (client/fleet_ops.py) ends within its timeout_s."""
import time

import pytest

from rollout_cluster.client import fleet_ops
from rollout_cluster.protocol import WeightsNotLearned


class Call:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        fn = self.fn
        return type("R", (), {"result": lambda self, timeout_s=None: fn(*args, **kwargs)})()


class SlowToNumberRouter:
    """A restarted router that refuses the order (WeightsNotLearned) for `learn_s`, then numbers it 7;
    the fleet never gets to version 7 (a replica that hangs in its load)."""

    def __init__(self, learn_s: float):
        self.learn_until = time.monotonic() + learn_s

        def update_weights(path, version, running):
            if time.monotonic() < self.learn_until:
                raise WeightsNotLearned("1 of the 2 replicas heard")
            self.numbered = True
            return 7

        self.numbered = False
        self.update_weights = Call(update_weights)


class Client:
    def __init__(self, router):
        self.router, self.call_timeout_s, self.config = router, 5.0, None

    def status(self) -> dict:
        version = 7 if self.router.numbered else 6
        return {"weights": {"version": version, "path": "/ckpt/x", "replicas": {"a": 6, "b": 6},
                            "held": ["a", "b"] if version == 6 else [], "errors": {}},
                "sleep": {"level": 0, "replicas": {"a": 0, "b": 0}, "errors": {}}, "expected_replicas": 2,
                "live_sequences": 0}


def test_update_weights_gives_up_within_its_timeout_even_after_a_slow_numbering(monkeypatch):
    """update_weights(timeout_s=T) takes one deadline for the whole call: the retries of a router
    that has not heard its fleet (numbered) and the wait for the version share it. Today the wait
    for the version starts a fresh T after numbering, so the call can last about 2 T."""
    monkeypatch.setattr(fleet_ops, "NUMBER_RETRY_S", 0.02)
    client = Client(SlowToNumberRouter(learn_s=0.8))
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        fleet_ops.update_weights(client, "/ckpt/x", None, timeout_s=1.0)
    elapsed = time.monotonic() - t0
    assert elapsed < 1.4, f"update_weights(timeout_s=1.0) returned after {elapsed:.2f} s"
