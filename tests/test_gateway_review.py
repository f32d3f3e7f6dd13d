"""Regression tests from a review of the Gateway's HTTP routes and trainer protocols
(serve/gateway.py, serve/protocols/): each test is named after the bug it caught."""
import json
import time

import pytest

from rollout_cluster.protocol import Completion, SeqProgress
from rollout_cluster.serve.protocols.batch import output_of
from test_protocols import AUTH, SCRIPT, TOKEN, TextRouter, app_over, codec, router  # noqa: F401 (fixtures)


def post(http, path, body):
    return http.post(path, content=body if isinstance(body, str) else json.dumps(body),
                     headers={**AUTH, "content-type": "application/json"})


# ---- a lone UTF-16 surrogate (JSON's "\ud800") in a string answered 500 ----------------------------
@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"prompt": "x \ud800", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2], "model": "\udc00", "max_tokens": 2}, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud83d"}], "max_tokens": 2},
     "messages[0].content"),
    ("/generate/", {"prompts": ["ok", "\ud800"], "max_tokens": 2}, "prompts[1]"),
    ("/chat/", {"messages": [[{"role": "user", "content": "\ud800"}]], "max_tokens": 2}, "messages[0][0].content"),
])
def test_a_lone_surrogate_in_a_string_is_a_400_naming_the_field_not_a_500(router, codec, path, body, field):
    http = app_over(router, codec)
    got = post(http, path, body)  # json.dumps writes the surrogate as the escape \ud800, as any client does
    assert got.status_code in (400, 422), got.text
    assert field in got.text and "surrogate" in got.text
    # a pair of escapes (one character past the BMP) is text, and passes
    ok = post(http, "/v1/completions", {"prompt": "smile \U0001F600", "max_tokens": 2})
    assert ok.status_code == 200, ok.text


# ---- pydantic's lax mode turned true, 2.0 and "2" into ints: a token id, a count, a port -----------
@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", {"prompt": [True, 2], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [1.0, 2], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "n": True}, "n"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": "2"}, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2.0}, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "stop_token_ids": [True]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "temperature": True}, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": True}, "max_tokens"),
    ("/generate/", {"prompts": [[True, 2]], "max_tokens": 2}, "prompts"),
    ("/generate/", {"prompts": [[1, 2]], "n": True, "max_tokens": 2}, "n"),
    ("/generate/", {"prompts": [[1, 2]], "max_tokens": "2"}, "max_tokens"),
    ("/generate/", {"prompts": [[1, 2]], "max_tokens": 2, "generation_kwargs": {"include_stop_str_in_output": "no"}},
     "include_stop_str_in_output"),
])
def test_a_bool_float_or_string_where_an_integer_is_meant_is_refused_not_coerced(router, codec, path, body, field):
    got = post(app_over(router, codec), path, body)
    assert got.status_code in (400, 422), got.text
    assert field in got.text
    assert not hasattr(router, "submitted")  # nothing ran


def test_strict_fields_still_take_what_the_real_clients_send(router, codec):
    http = app_over(router, codec)
    ok = post(http, "/v1/completions", {"prompt": [[1, 2], [3]], "max_tokens": 2, "n": 2, "temperature": 1,
                                        "top_p": 1, "stream": False, "logprobs": 0, "stop": ["x"], "seed": 3})
    assert ok.status_code == 200, ok.text
    ok = post(http, "/generate/", {"prompts": ["a"], "n": 1, "repetition_penalty": 1, "temperature": 1, "top_p": 1,
                                   "top_k": -1, "min_p": 0, "max_tokens": 2, "logprobs": 0, "images": None,
                                   "structured_outputs_regex": None, "truncate_prompt_tokens": None,
                                   "generation_kwargs": {"include_stop_str_in_output": True}})
    assert ok.status_code == 200, ok.text


# ---- stop strings: every token searched the whole text for every stop (tokens^2 x stops, unbounded) --
def _reference_cut(codec, ids, stops, include):
    """What output_of did before (a token at a time, every stop searched in the whole text so far)."""
    from tokenizers.decoders import DecodeStream

    stream, text = DecodeStream(skip_special_tokens=True), ""
    for k, t in enumerate(ids):
        text += stream.step(codec.tokenizer, t) or ""
        hit = min(((text.find(s), s) for s in stops if s and s in text), default=None)
        if hit is not None:
            at, s = hit
            return ids[:k + 1], (text[:at + len(s)] if include else text[:at]), s
    return ids, codec.decode(ids), None


def _ctx(codec):
    from rollout_cluster.config import LimitsConfig
    from rollout_cluster.serve.protocols.batch import ProtocolContext

    return ProtocolContext(None, codec, LimitsConfig(), 5.0, model_name="m", model_root="/m")


@pytest.mark.parametrize("stops", [["gamma"], ["a b", "beta"], ["ta ga", "eta", "zeta"], ["lambda", "l"],
                                   ["", "mu"], ["kappa lambda mu alpha"], ["nowhere"], ["e", "ep"], ["a", "alpha"]])
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_cut_where_a_token_at_a_time_search_cut(codec, stops, include):  # noqa: F811
    ids = codec.encode(SCRIPT) * 3
    lps = [-0.25 * i for i in range(len(ids))]
    out = output_of(_ctx(codec), Completion(0, 0, ids, lps, "length"), stops, include)
    want_ids, want_text, want_stop = _reference_cut(codec, ids, stops, include)
    assert (out.token_ids, out.text, out.stop_reason) == (want_ids, want_text, want_stop)
    assert out.logprobs == lps[:len(want_ids)] and out.finish_reason == ("length" if want_stop is None else "stop")


def test_many_stop_strings_over_a_long_output_take_linear_time_not_a_wedge(codec):  # noqa: F811
    """1000 stop strings that never match over 4000 tokens took 4.9 s of the event loop per
    sequence (n of them a request: minutes of a Gateway that answers nothing else)."""
    ids = (codec.encode(SCRIPT) * 400)[:4000]
    stops = [f"zz{i}" for i in range(1000)]
    start = time.perf_counter()
    out = output_of(_ctx(codec), Completion(0, 0, ids, None, "length"), stops)
    assert time.perf_counter() - start < 1.0 and out.token_ids == ids


def test_more_stop_strings_than_the_cap_are_refused_naming_stop(router, codec):  # noqa: F811
    from rollout_cluster.serve.protocols.batch import MAX_STOP_STRINGS

    http = app_over(router, codec)
    many = [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
    got = post(http, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "stop": many})
    assert got.status_code == 400 and got.json()["error"]["param"] == "stop", got.text
    got = post(http, "/generate/", {"prompts": [[1, 2]], "max_tokens": 2, "generation_kwargs": {"stop": many}})
    assert got.status_code == 422 and "generation_kwargs.stop" in got.text
    assert post(http, "/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "stop": many[:-1]}).status_code == 200


# ---- a NaN logprob (weights that diverged) made every non-streamed answer a 500 ----------------------
class NanRouter(TextRouter):
    """TextRouter whose engine writes NaN logprobs, as one does on weights that went NaN."""

    def report(self, progress, model=None):
        progress = [SeqProgress(p.seq_id, p.attempt, p.token_ids, None if p.logprobs is None else
                                [float("nan")] * len(p.logprobs), p.finish_reason, offset=p.offset) for p in progress]
        return super().report(progress, model)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 3, "logprobs": 0}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "logprobs": True}),
    ("/generate/", {"prompts": [[1, 2]], "max_tokens": 3}),
])
def test_a_nan_logprob_is_answered_as_nan_not_a_500(codec, path, body):  # noqa: F811
    """Starlette's JSONResponse refuses NaN (allow_nan=False): the answer raised, a 500 that TRL's
    client retries, running the whole batch again. The streamed and JSONL routes wrote NaN already;
    the JSON answers now do too (Python's json, which the openai package and TRL read with, takes it)."""
    got = post(app_over(NanRouter(codec), codec), path, body)
    assert got.status_code == 200, got.text
    assert "NaN" in got.text and json.loads(got.text)


# ---- a request abandoned mid-batch (the client hung up, timed out) left its batch running ------------
class LongPoll:
    """A Serve method whose call waits a while first, as the router's fetch long-polls."""

    def __init__(self, fn, wait_s: float = 0.05):
        self.fn, self.wait_s = fn, wait_s

    def remote(self, *args):
        import asyncio

        async def call():
            await asyncio.sleep(self.wait_s)
            return self.fn(*args)
        return call()


class StuckRouter(TextRouter):
    """TextRouter whose replica finishes nothing (a long batch) and whose fetch long-polls; records
    each cancel."""

    def __init__(self, codec):
        super().__init__(codec, per_fetch=0)
        self.cancels = []
        self.fetch = LongPoll(self._fetch)
        self.cancel = type(self.cancel)(lambda bid: (self.cancels.append(bid), self._cancel(bid))[1])


def _asgi_call(app, path: str, body: dict):
    """The app's ASGI call for one POST, as Serve's proxy makes it; the client never hangs up by itself."""
    import asyncio

    from test_protocols import TOKEN

    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive():
        if messages:
            return messages.pop(0)
        await asyncio.Event().wait()

    async def send(message):
        pass

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"authorization", f"Bearer {TOKEN}".encode()), (b"content-type", b"application/json")],
             "server": ("testserver", 80), "client": ("testclient", 1)}
    return app(scope, receive, send)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 3, "n": 4}),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 3, "n": 4, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
    ("/generate/", {"prompts": [[1, 2]], "max_tokens": 3}),
    ("/generate", {"prompt_token_ids": [1, 2], "max_tokens": 3}),  # our JSONL route: one line
])
def test_a_request_cancelled_mid_batch_cancels_its_batch(codec, path, body):  # noqa: F811
    """Serve cancels the request's task when its client hangs up (a client-side timeout: the openai
    package then retries); the batch ran on, holding replicas and max_live_sequences, until
    router.abandoned_batch_s (900 s) dropped it."""
    import asyncio

    router = StuckRouter(codec)
    app = app_over(router, codec).app

    async def scenario():
        task = asyncio.ensure_future(_asgi_call(app, path, body))
        for _ in range(500):
            await asyncio.sleep(0.01)
            if router.core.batches:
                break
        assert router.core.batches and not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            await asyncio.sleep(0.01)
            if router.cancels:
                break

    asyncio.run(scenario())
    assert router.cancels == list(router.core.batches)


# ---- a prompt's text was tokenized whole however long: 64 MiB of body, ~50 s of the event loop -------
@pytest.mark.parametrize("path, body, field", [
    ("/v1/completions", lambda text: {"prompt": text, "max_tokens": 2}, "prompt"),
    ("/v1/completions", lambda text: {"prompt": ["ok", text], "max_tokens": 2}, "prompt[1]"),
    ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 2},
     "messages"),
    ("/generate/", lambda text: {"prompts": [text], "max_tokens": 2}, "prompts[0]"),
    ("/chat/", lambda text: {"messages": [[{"role": "user", "content": text}]], "max_tokens": 2}, "messages[0]"),
])
def test_a_text_longer_than_the_context_could_hold_is_refused_before_tokenizing(router, codec, monkeypatch,
                                                                                path, body, field):  # noqa: F811
    """The tiny model's context is 4096 tokens of at most 100 characters: 2 MB of text cannot fit,
    and is refused without a tokenizer call (5.6 MB took 4.5 s of the Gateway's event loop here)."""
    encoded = []
    real = codec.encode
    monkeypatch.setattr(codec, "encode", lambda text, *a, **kw: (encoded.append(len(text)), real(text, *a, **kw))[1])
    http = app_over(router, codec)
    got = post(http, path, body("alpha beta " * 200_000))
    assert got.status_code in (400, 422), got.text
    assert field in got.text and "max_model_len=4096" in got.text
    assert all(n < 1000 for n in encoded)  # only the short prompt ("ok") was tokenized
    # a text the context can hold is tokenized as before (here refused by its token count, not unread)
    got = post(http, path, body("alpha beta " * 2_000))
    assert got.status_code in (400, 422) and "max_model_len=4096" in got.text and max(encoded) > 20_000


# ---- a streamed request to a full router: 200 and an error event, where the docs promise 503 ---------
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}),
])
def test_a_streamed_request_to_a_full_router_answers_503_with_retry_after(router, codec, path, body):  # noqa: F811
    """docs/trainers.md: 503 with Retry-After when the router holds limits.max_live_sequences. A
    stream answered 200 first, then the refusal as an event, which the openai package raises as an
    APIError it does not retry, without the Retry-After."""
    http = app_over(router, codec)
    router.busy = True
    got = post(http, path, body)
    assert got.status_code == 503 and got.headers["retry-after"] == "5", got.text
    assert "max_live_sequences" in got.json()["error"]["message"]
    router.busy = False  # and a stream that runs still sends every choice (chat: after each one's role), then [DONE]
    raw = post(http, path, {**body, "n": 3}).text
    assert raw.count("data: ") == (7 if "chat" in path else 4) and raw.endswith("data: [DONE]\n\n")


# ---- limits.max_timeout_s below 3600 refused every /generate that left timeout_s to its default ------
def test_the_default_timeout_is_within_limits_max_timeout_s(router, codec):  # noqa: F811
    """limits.max_timeout_s: 600 made `?timeout_s=`'s default (3600) out of range: every batch that
    did not name a timeout was a 400. The protocol routes' batches ran up to 3600 s whatever it said."""
    from rollout_cluster.config import LimitsConfig
    from rollout_cluster.serve.gateway import gateway_app
    from rollout_cluster.serve.protocols.batch import ProtocolContext
    from starlette.testclient import TestClient

    limits = LimitsConfig(max_timeout_s=600)
    ctx = ProtocolContext(router, codec, limits, 5.0, model_name="models/tiny", model_root="/m/tiny")
    http = TestClient(gateway_app(router, {}, 5.0, TOKEN, limits, ctx))
    got = http.post("/generate", content=json.dumps({"prompt_token_ids": [5, 6], "max_tokens": 4}) + "\n",
                    headers=AUTH)
    assert got.status_code == 200 and json.loads(got.text)["finish_reason"] == "length", got.text
    assert ctx.batch_timeout_s == 600
    assert http.post("/generate?timeout_s=601", content="", headers=AUTH).status_code == 400  # a named one still is


def test_a_request_cancelled_while_its_submit_is_under_way_cancels_the_batch_once_it_is_answered(codec):  # noqa: F811
    """A request cancelled before the router answered its submit never learned the batch's id: the
    batch ran on unfollowed until router.abandoned_batch_s."""
    import asyncio

    class SlowAnswer:  # the router takes the batch at once; its answer comes back 0.3 s later
        @staticmethod
        def remote(*args):
            answer = router._submit_batch(*args)

            async def call():
                await asyncio.sleep(0.3)
                return answer
            return call()

    router = StuckRouter(codec)
    router.submit_batch = SlowAnswer
    app = app_over(router, codec).app

    async def scenario():
        task = asyncio.ensure_future(_asgi_call(app, "/v1/completions", {"prompt": [1, 2], "max_tokens": 3}))
        await asyncio.sleep(0.1)
        assert router.core.batches and not router.cancels  # submitted; its answer is under way
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):
            await asyncio.sleep(0.02)
            if router.cancels:
                break

    asyncio.run(scenario())
    assert router.core.batches and router.cancels == list(router.core.batches)


# ---- chat fields that ask for what the engines cannot do were ignored, not refused ------------------
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_chat_top_logprobs_without_logprobs_is_refused_as_vllm_refuses_it(router, codec):  # noqa: F811
    """top_logprobs=5 with logprobs false was silently ignored (with logprobs true it is refused by
    name); vLLM's server refuses top_logprobs unless logprobs is true."""
    got = post(app_over(router, codec), "/v1/chat/completions", {**CHAT, "top_logprobs": 5})
    assert got.status_code == 400 and got.json()["error"]["param"] == "top_logprobs", got.text
    for ok in ({"top_logprobs": 0}, {"top_logprobs": None}, {"logprobs": False, "top_logprobs": None}):
        assert post(app_over(router, codec), "/v1/chat/completions", {**CHAT, **ok}).status_code == 200


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_a_tool_choice_that_forces_a_call_is_refused_by_name_not_ignored(router, codec, tool_choice):  # noqa: F811
    """vLLM enforces `required` or a named function with structured outputs (guided decoding, which
    docs/trainers.md says is refused by name); here it was ignored, and the answer held no call."""
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}]
    http = app_over(router, codec)
    got = post(http, "/v1/chat/completions", {**CHAT, "tools": tools, "tool_choice": tool_choice})
    assert got.status_code == 400 and got.json()["error"]["param"] == "tool_choice", got.text
    for ok in ("none", "auto"):  # TRL sends "none": the tools are only rendered into the prompt
        assert post(http, "/v1/chat/completions", {**CHAT, "tools": tools, "tool_choice": ok}).status_code == 200
