"""The batch routes' answers skip FastAPI's jsonable_encoder (bench/protocols.py measured it at
150-220 ms of the Gateway's CPU for a 64 x 128-token answer on the local VM, most of the HTTP
paths' overhead against the driver API), with the same bytes; and the Gateway's call timeline
(serve/call_timeline.py) records a request's arrival, its router calls and its answer."""
import json

import fastapi.routing
import pytest
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse

from rollout_cluster.serve.call_timeline import TRACE_HEADER, CallTimeline, TimedRouter
from rollout_cluster.serve.gateway import gateway_app
from rollout_cluster.serve.protocols.batch import answer
from test_protocols import AUTH, TOKEN, app_over, codec, router  # noqa: F401 (fixtures)


@pytest.fixture
def encoded(monkeypatch):
    """What FastAPI's encoder is asked to walk: large answers only (status and errors may go through it)."""
    seen = []

    def spy(obj, *a, **kw):
        seen.append(len(json.dumps(obj, default=str)))
        return jsonable_encoder(obj, *a, **kw)

    monkeypatch.setattr(fastapi.routing, "jsonable_encoder", spy)
    return seen


BODIES = {
    "/generate/": {"prompts": [[5, 6, 7], [8, 9]], "n": 4, "max_tokens": 50, "generation_kwargs": {"ignore_eos": True}},
    "/chat/": {"messages": [[{"role": "user", "content": "Prove that"}]], "n": 4, "max_tokens": 50},
    "/v1/completions": {"prompt": [[5, 6, 7], [8, 9]], "n": 4, "max_tokens": 50, "logprobs": 0, "ignore_eos": True,
                        "return_token_ids": True},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Prove that"}], "n": 4, "max_tokens": 50,
                             "logprobs": True, "return_token_ids": True},
}


@pytest.mark.parametrize("path", sorted(BODIES))
def test_batch_answers_skip_fastapis_encoder(router, codec, encoded, path):  # noqa: F811
    got = app_over(router, codec).post(path, json=BODIES[path], headers=AUTH)
    assert got.status_code == 200, got.text
    assert got.headers["content-type"] == "application/json" and len(got.content) > 2000
    assert encoded == []  # the answer went out as it was rendered, not walked first


def test_a_rendered_answer_has_the_bytes_fastapis_encoder_gives():
    body = {"id": "cmpl-1", "choices": [{"index": 0, "text": "héllo ✓", "logprobs": {"token_logprobs": [-0.5, -1e-9],
            "top_logprobs": [{"h": -0.5}]}, "token_ids": (1, 2), "stop_reason": None, "ok": True}],
            "usage": {"prompt_tokens": 3}}
    assert answer(body).body == JSONResponse(jsonable_encoder(body)).body


def test_the_gateway_timeline_follows_a_request(router, codec, tmp_path):  # noqa: F811
    lines = []
    timeline = CallTimeline(sink=lines.append)
    from rollout_cluster.config import LimitsConfig
    from rollout_cluster.serve.protocols.batch import ProtocolContext
    from starlette.testclient import TestClient

    timed = TimedRouter(router, timeline)
    ctx = ProtocolContext(timed, codec, LimitsConfig(), 5.0, model_name="models/tiny", model_root="/m/tiny")
    http = TestClient(gateway_app(timed, {}, 5.0, TOKEN, LimitsConfig(), ctx, timeline=timeline))
    got = http.post("/generate/", json=BODIES["/generate/"], headers={**AUTH, TRACE_HEADER: "r0-trl"})
    assert got.status_code == 200
    kinds = [x["kind"] for x in lines if x["label"] == "r0-trl"]
    assert kinds[0] == "received" and kinds[1] == "submit_batch" and kinds[-1] == "answered"
    fetches = [x for x in lines if x["kind"] == "fetch"]
    assert fetches and fetches[-1]["done"] and sum(x["new"] for x in fetches) == 8
    assert all(x["sent"] <= x["t"] for x in lines if "sent" in x)


def test_token_texts_are_decoded_once_per_token_id(codec, monkeypatch):  # noqa: F811
    from rollout_cluster.config import LimitsConfig
    from rollout_cluster.serve.protocols.batch import ProtocolContext

    ctx = ProtocolContext(None, codec, LimitsConfig(), 5.0, model_name="m", model_root="m")
    ids = codec.encode("alpha beta gamma alpha beta") * 3
    assert ctx.token_texts(ids) == codec.token_texts(ids)
    asked = []
    monkeypatch.setattr(codec, "token_texts", lambda new: asked.append(new) or [f"?{t}" for t in new])
    assert ctx.token_texts(ids) == [codec.tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    assert asked == []  # every id was seen: the tokenizer is not asked again
    assert ctx.token_texts([999]) == ["?999"] and asked == [[999]]
