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
    monkeypatch.setattr(lease_mod, "CHECK_S", 0.3)
    monkeypatch.setattr(lease_mod, "RETRY_S", 0.01)
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


def test_a_lease_unreachable_then_dead_is_replaced_and_one_unreachable_throughout_is_kept(made, monkeypatch):
    """A killed lease is first unreachable, then dead (what CI saw: the kept dead lease would abort the
    live trainer's push): the ping is asked again until Ray decides, or kept when it never does."""
    first = lease_mod.lease_of_this_process()
    answers = [ActorUnavailableError("the actor is being killed", b"\0" * 16)] * 3 + [ActorDiedError()]

    def get(ref, timeout=None):
        raise answers.pop(0) if len(answers) > 1 else answers[0]

    monkeypatch.setattr(ray, "get", get)
    second = lease_mod.lease_of_this_process()
    assert second is not first and len(made) == 2
    answers[:] = [ActorUnavailableError("the node is busy", b"\0" * 16)]
    assert lease_mod.lease_of_this_process() is second and len(made) == 2
