"""The trainer's lease (transfer/lease.py) as the trainer's process keeps it: made once per Ray
session and process, kept while it answers or is only unreachable for a while, replaced once Ray
says it died. Ray's calls are stood in for here; the real actor's death and replacement run in
tests/e2e/test_push_weights_vllm.py."""
import pytest
import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError

from rollout_cluster.transfer import lease as lease_mod


class Ctx:
    def get_session_name(self): return "s1"
    def get_job_id(self): return "j1"
    def get_worker_id(self): return "w1"
    def get_node_id(self): return "n1"
    gcs_address = "127.0.0.1:6379"


class Lease:
    class alive:  # noqa: N801 (an actor method's shape: lease.alive.remote())
        @staticmethod
        def remote():
            return "ping"


@pytest.fixture
def made(monkeypatch):
    leases = []
    monkeypatch.setattr(lease_mod, "_leases", {})
    monkeypatch.setattr(ray, "get_runtime_context", lambda: Ctx())
    monkeypatch.setattr(lease_mod, "_make", lambda ctx: leases.append(Lease()) or leases[-1])
    return leases


@pytest.mark.parametrize("answer,replaced", [
    (None, False), (GetTimeoutError("slow"), False), (ActorUnavailableError("the node is busy", b"\0" * 16), False),
    (ActorDiedError(), True)])
def test_a_lease_is_replaced_only_once_ray_says_it_died(made, monkeypatch, answer, replaced):
    first = lease_mod.lease_of_this_process()
    assert made == [first]

    def get(ref, timeout=None):
        if answer is not None:
            raise answer
        return True

    monkeypatch.setattr(ray, "get", get)
    again = lease_mod.lease_of_this_process()
    assert (again is not first) == replaced and len(made) == 1 + replaced
