"""Regression: with the router down (its process died: the Serve handle's call raises
RayActorError / ActorDiedError, or Serve has no replica of it: ReplicaUnavailableError,
DeploymentUnavailableError; or the call goes unanswered while Serve restarts it), GET /,
/v1/models, /server_info, /weight_info and every route's model-info call answered 500 (an
exception out of the route), or waited without bound. They answer 503 with Retry-After, as a full
router does, in each protocol's own error shape, and a call that goes unanswered for
call_timeout_s counts as a router that is not there (client/loops.router_gone)."""
import asyncio

import pytest
from ray.exceptions import ActorDiedError, ActorUnavailableError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from starlette.testclient import TestClient

from rollout_cluster.config import LimitsConfig
from rollout_cluster.serve.gateway import gateway_app
from rollout_cluster.serve.protocols.context import ProtocolContext
from rollout_cluster.serve.protocols.trl_weights import RelayRunner
from rollout_cluster.transfer.relay import WeightRelay
from test_protocols import AUTH, TOKEN, TextRouter, codec  # noqa: F401 (fixtures)

CALL_TIMEOUT_S = 0.5


class Hung:
    """A call Serve holds while the router has no replica: never answered."""

    def __await__(self):
        return asyncio.Event().wait().__await__()


class DownStatus:
    def __init__(self, error):
        self.error = error

    def remote(self, *args):
        if self.error is None:
            return Hung()
        raise self.error


def app_without_router(codec, error, down: str = "status"):
    router = TextRouter(codec)
    setattr(router, down, DownStatus(error))
    limits = LimitsConfig(retry_after_s=7)
    ctx = ProtocolContext(router, codec, limits, CALL_TIMEOUT_S, model_name="models/tiny", model_root="/m/tiny")
    runner = RelayRunner(WeightRelay({"w.weight": (2, 3)}, lambda named: 1, "cpu", timeout_s=5))
    # raise_server_exceptions=False: an exception out of a route is the 500 a client gets
    return TestClient(gateway_app(router, {}, CALL_TIMEOUT_S, TOKEN, limits, ctx, runner),
                      raise_server_exceptions=False)


DOWN = [ActorDiedError(), ActorUnavailableError("the router's actor is restarting", None),
        ReplicaUnavailableError("no replica"), DeploymentUnavailableError("Router"), None]
IDS = ["ActorDiedError", "ActorUnavailableError", "ReplicaUnavailableError", "DeploymentUnavailableError", "hung"]


def unavailable(answer) -> None:
    assert answer.status_code == 503, answer.text
    assert answer.headers["retry-after"] == "7"


@pytest.mark.parametrize("error", DOWN, ids=IDS)
def test_router_down_answers_503_not_500_on_status_routes(codec, error):
    http = app_without_router(codec, error)
    answer = http.get("/", headers=AUTH)
    unavailable(answer)
    assert "router" in answer.json()["error"]
    answer = http.get("/v1/models", headers=AUTH)
    unavailable(answer)
    assert answer.json()["error"]["type"] == "ServiceUnavailableError" and answer.json()["error"]["code"] == 503
    for path in ("/server_info", "/weight_info"):
        answer = http.get(path, headers=AUTH)
        unavailable(answer)
        assert "router" in answer.json()["detail"]


@pytest.mark.parametrize("error", DOWN, ids=IDS)
def test_router_down_answers_503_from_the_routes_model_info_call(codec, error):
    http = app_without_router(codec, error)
    for route, body in (("/v1/completions", {"prompt": "Prove that", "max_tokens": 2}),
                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        answer = http.post(route, headers=AUTH, json=body)
        unavailable(answer)
        assert answer.json()["error"]["type"] == "ServiceUnavailableError"
    for route, body in (("/generate/", {"prompts": ["Prove that"], "max_tokens": 2}),
                        ("/chat/", {"messages": [[{"role": "user", "content": "hi"}]], "max_tokens": 2})):
        answer = http.post(route, headers=AUTH, json=body)
        unavailable(answer)
        assert "router" in answer.json()["detail"]


def test_a_router_error_that_is_no_absence_is_still_a_500(codec):
    http = app_without_router(codec, KeyError("a bug in status"))
    assert http.get("/", headers=AUTH).status_code == 500
    assert http.get("/v1/models", headers=AUTH).status_code == 500



@pytest.mark.parametrize("error", DOWN, ids=IDS)
def test_router_down_at_reset_prefix_cache_is_503_not_a_failed_weight_update(codec, error):
    """Regression: /reset_prefix_cache answered 409 "weight update failed" with the router down,
    which TRL's client does not retry (a 503 it does, and dropping the cache again is harmless)."""
    http = app_without_router(codec, error, down="reset_prefix_cache")
    for path in ("/reset_prefix_cache/", "/reset_prefix_cache"):
        answer = http.post(path, headers=AUTH)
        unavailable(answer)
        assert "router" in answer.json()["detail"] and "weight update" not in answer.json()["detail"]
