"""The OpenAI-compatible and TRL routes of the Gateway over an in-process router (a real
RouterCore and one fake replica), driven by the real `openai` client where it can be: its HTTP
client is Starlette's TestClient. The e2e suite drives them on real engines with TRL's own
VLLMClient too (tests/e2e/test_trainer_protocols.py)."""
import json

import openai
import pytest
from starlette.testclient import TestClient

from rollout_cluster.config import LimitsConfig
from rollout_cluster.protocol import ModelInfo, SeqProgress
from rollout_cluster.serve.gateway import gateway_app
from rollout_cluster.serve.protocols.batch import ProtocolContext
from rollout_cluster.text.codec import TextCodec
from rollout_cluster.text.make_tokenizer import make_tokenizer
from ports import free_port
from test_router_restart import FakeRouter, Method

TOKEN = "proto-token-" + "z" * 24
SCRIPT = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"


@pytest.fixture(scope="module")
def codec(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    make_tokenizer(str(folder), vocab_size=1000)
    return TextCodec.load(str(folder))


class TextRouter(FakeRouter):
    """The fake replica writes SCRIPT's tokens (from the start, cut at max_tokens), each with
    logprob -0.5; `status` and `reset_prefix_cache` answer as the Router's do."""

    def __init__(self, codec, per_fetch=3):
        self.script = codec.encode(SCRIPT) * 20
        self.resets = 0
        self.busy = False
        super().__init__(per_fetch)
        self.status = Method(lambda: {"model": ModelInfo(1000, 4096).__dict__, "expected_replicas": 2, "replicas": {}})
        self.reset_prefix_cache = Method(self._reset)

    def _reset(self):
        self.resets += 1
        return True

    def _submit(self, requests, *a, **kw):
        if self.busy:
            from rollout_cluster.router.limits import BatchLimits

            BatchLimits(max_live_sequences=1).check_batch(len(requests), live=1)
        self.submitted = requests
        return super()._submit(requests, *a, **kw)

    def _fetch(self, batch_id, cursor, wait_s):
        self.running += self.core.decide("a", self.now).start
        done, self.running = self.running[:self.per_fetch], self.running[self.per_fetch:]
        self.report([SeqProgress(w.seq_id, w.attempt, self.script[:w.sampling.max_tokens],
                                 [-0.5] * w.sampling.max_tokens if w.sampling.logprobs is not None else None,
                                 "length", offset=0) for w in done])
        new, cursor, finished = self.core.fetch(batch_id, cursor, self.now)
        if finished:
            self.core.release(batch_id)
        return new, cursor, finished


@pytest.fixture
def router(codec):
    return TextRouter(codec)


def app_over(router, codec, **limits):
    ctx = ProtocolContext(router, codec, LimitsConfig(**limits), 5.0, model_name="models/tiny", model_root="/m/tiny",
                          world_size=1)
    return TestClient(gateway_app(router, {}, 5.0, TOKEN, LimitsConfig(**limits), ctx))


@pytest.fixture
def http(router, codec):
    return app_over(router, codec)


@pytest.fixture
def client(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key=TOKEN, http_client=http, max_retries=0)


# ---- OpenAI ---------------------------------------------------------------------------------------
def test_models_lists_the_served_model(client):
    (m,) = client.models.list().data
    assert m.id == "models/tiny" and m.model_extra["max_model_len"] == 4096


def test_text_completion_with_n_logprobs_and_token_ids(client, codec):
    out = client.completions.create(model="models/tiny", prompt="Prove that", n=2, max_tokens=5, logprobs=0,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    ids = codec.encode(SCRIPT)[:5]
    assert [c.index for c in out.choices] == [0, 1]
    for c in out.choices:
        assert c.model_extra["token_ids"] == ids and c.text == codec.decode(ids) and c.finish_reason == "length"
        assert c.model_extra["prompt_token_ids"] == codec.encode("Prove that")
        assert c.logprobs.token_logprobs == [-0.5] * 5 and "".join(c.logprobs.tokens) == c.text
        assert c.logprobs.text_offset[0] == 0 and c.logprobs.top_logprobs[0] == {c.logprobs.tokens[0]: -0.5}
    assert out.usage.completion_tokens == 10 and out.usage.prompt_tokens == len(codec.encode("Prove that"))


def test_token_id_prompts_come_back_prompt_major(client):
    out = client.completions.create(model="models/tiny", prompt=[[5, 6, 7], [8, 9]], n=3, max_tokens=4,
                                    extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True},
                                    logprobs=0)
    assert [c.index for c in out.choices] == list(range(6))
    assert [c.model_extra["prompt_token_ids"] for c in out.choices] == [[5, 6, 7]] * 3 + [[8, 9]] * 3
    assert all(c.logprobs.tokens == [f"token_id:{t}" for t in c.model_extra["token_ids"]] for c in out.choices)


def test_a_stream_sends_every_choice_once_then_done(client, codec, http):
    chunks = list(client.completions.create(model="models/tiny", prompt=["a b", "c d"], n=2, max_tokens=6,
                                            stream=True, stream_options={"include_usage": True}))
    by_index = {}
    for ch in chunks:
        for c in ch.choices:
            assert c.index not in by_index  # each choice once, whole
            by_index[c.index] = c
    assert sorted(by_index) == [0, 1, 2, 3] and chunks[-1].usage.completion_tokens == 24
    assert all(c.text == codec.decode(codec.encode(SCRIPT)[:6]) for c in by_index.values())
    raw = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2, "stream": True},
                    headers={"Authorization": f"Bearer {TOKEN}"}).text
    assert raw.endswith("data: [DONE]\n\n") and raw.count("data: ") == 2


def test_stop_strings_cut_the_text_and_the_tokens(client, codec):
    out = client.completions.create(model="models/tiny", prompt="x", max_tokens=30, stop=["gamma"],
                                    extra_body={"return_token_ids": True})
    (c,) = out.choices
    assert c.text == "alpha beta " and c.finish_reason == "stop" and c.model_extra["stop_reason"] == "gamma"
    assert "gamma" in codec.decode(c.model_extra["token_ids"]) and len(c.model_extra["token_ids"]) < 30


def test_chat_renders_the_template_and_returns_the_prompt_ids(client, codec):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is two plus two?"}]
    out = client.chat.completions.create(model="models/tiny", messages=messages, n=2, max_tokens=4, logprobs=True,
                                         extra_body={"return_token_ids": True})
    prompt = codec.encode(codec.render_chat(messages), add_special_tokens=False)
    assert out.model_extra["prompt_token_ids"] == prompt
    # the markers are single special tokens (<|im_start|> is id 1), skipped when decoded
    assert prompt[0] == 1 and codec.decode(prompt) == "system\nBe brief.\nuser\nWhat is two plus two?\nassistant\n"
    for c in out.choices:
        assert c.message.role == "assistant" and c.message.content == codec.decode(codec.encode(SCRIPT)[:4])
        assert [x.logprob for x in c.logprobs.content] == [-0.5] * 4 and c.logprobs.content[0].top_logprobs == []
    chunks = list(client.chat.completions.create(model="models/tiny", messages=messages, n=2, max_tokens=3,
                                                 stream=True))
    # vLLM's: each choice's role chunk first (empty content), then its text (once here: whole)
    assert [(c.index, c.delta.role, c.delta.content) for ch in chunks[:2] for c in ch.choices] == [
        (0, "assistant", ""), (1, "assistant", "")]
    assert sorted((c.index, c.delta.role, c.delta.content) for ch in chunks[2:] for c in ch.choices) == [
        (i, None, codec.decode(codec.encode(SCRIPT)[:3])) for i in (0, 1)]


@pytest.mark.parametrize("kwargs, error, param", [
    ({"logprobs": 2}, openai.BadRequestError, "logprobs"),
    ({"model": "other-model"}, openai.NotFoundError, "model"),
    ({"echo": True}, openai.BadRequestError, "echo"),
    ({"temperature": -1.0}, openai.BadRequestError, "temperature"),
    ({"n": 5000}, openai.BadRequestError, "n"),
    ({"extra_body": {"top_k": "many"}}, openai.BadRequestError, "body.top_k"),
    ({"prompt": [[1, 5000]]}, openai.BadRequestError, "prompt_token_ids"),
    ({"extra_body": {"min_p": 1.5}}, openai.BadRequestError, "min_p"),
])
def test_bad_fields_are_named_in_openais_error_shape(client, kwargs, error, param):
    args = {"model": "models/tiny", "prompt": "hi", "max_tokens": 3, **kwargs}
    with pytest.raises(error) as e:
        client.completions.create(**args)
    assert e.value.body["param"] == param and e.value.body["code"] == e.value.status_code


def test_the_token_is_required_and_basic_auth_carries_it_too(http, router, codec):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=http,
                      max_retries=0).models.list()
    assert http.get("/v1/models").status_code == 401
    assert http.get("/v1/models", auth=("trl", TOKEN)).status_code == 200  # http://trl:<token>@host/...
    assert http.get("/v1/models", auth=("trl", "wrong")).status_code == 401
    for path in ("/health", "/health/", "/healthz"):  # liveness: no token (TRL polls it bare)
        assert http.get(path).status_code == 200


def test_a_full_router_answers_503_with_retry_after(http, router, client):
    router.busy = True
    answer = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2},
                       headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 503 and answer.headers["retry-after"] == "5"
    assert "max_live_sequences" in answer.json()["error"]["message"]
    answer = http.post("/generate/", json={"prompts": [[1, 2]]}, headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 503 and answer.headers["retry-after"] == "5"


def test_no_tokenizer_means_token_ids_only(router):
    http = app_over(router, None)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    answer = http.post("/v1/completions", json={"prompt": "text", "max_tokens": 2}, headers=auth)
    assert answer.status_code == 400 and "no tokenizer" in answer.json()["error"]["message"]
    answer = http.post("/v1/completions", json={"prompt": [3, 4], "max_tokens": 2, "return_token_ids": True},
                       headers=auth)
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == ""


# ---- TRL up to 1.10 -------------------------------------------------------------------------------
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_trl_generate_with_strings_and_ids(http, codec):
    answer = http.post("/generate/", json={"prompts": ["Prove that", "Solve"], "n": 2, "max_tokens": 4,
                                           "generation_kwargs": {"ignore_eos": True, "seed": 3}}, headers=AUTH)
    body = answer.json()
    assert answer.status_code == 200 and body["prompt_ids"] == [codec.encode("Prove that"), codec.encode("Solve")]
    assert body["completion_ids"] == [codec.encode(SCRIPT)[:4]] * 4
    assert body["logprobs"] == [[[-0.5]] * 4] * 4 and body["logprob_token_ids"] == [[[t] for t in ids]
                                                                                  for ids in body["completion_ids"]]
    body = http.post("/generate/", json={"prompts": [[7, 8], [9]], "max_tokens": 3, "logprobs": None},
                     headers=AUTH).json()
    assert body["prompt_ids"] == [[7, 8], [9]] and body["logprobs"] is None and len(body["completion_ids"]) == 2


def test_sampling_fields_reach_the_router_as_vllm_names_them(http, client, router):
    client.completions.create(model="models/tiny", prompt=[1, 2], max_tokens=2, top_p=0.9,
                              extra_body={"min_p": 0.05, "top_k": 7, "repetition_penalty": 1.1})
    (spec,) = {r.sampling for r in router.submitted}
    assert (spec.min_p, spec.top_k, spec.top_p, spec.repetition_penalty) == (0.05, 7, 0.9, 1.1)
    http.post("/generate/", json={"prompts": [[3]], "n": 2, "min_p": 0.2, "max_tokens": 2,
                                  "generation_kwargs": {"seed": 11, "top_k": 3}}, headers=AUTH)
    first, second = [r.sampling for r in router.submitted]
    assert (first.min_p, first.seed, first.top_k, first.n) == (0.2, 11, 3, 2)
    assert second.seed == 12 and second == first.for_sample(1)  # sample j: seed + j, as vLLM's n


def test_a_session_comes_from_the_header_else_from_user(client, router):
    client.completions.create(model="models/tiny", prompt=[1, 2], max_tokens=2, user="u-1",
                              extra_headers={"X-Session-Id": "agent-9"})
    assert {r.session for r in router.submitted} == {"agent-9"}
    client.chat.completions.create(model="models/tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                   user="u-1")
    assert {r.session for r in router.submitted} == {"u-1"}
    client.completions.create(model="models/tiny", prompt=[[1], [2]], max_tokens=2)
    assert {r.session for r in router.submitted} == {None}
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="models/tiny", prompt=[1], max_tokens=2, extra_headers={"X-Session-Id": "x" * 300})
    assert e.value.body["param"] == "X-Session-Id"  # named where it came from


def test_chat_takes_text_parts_and_refuses_images_and_own_templates_by_name(client, codec, router):
    parts = [{"type": "text", "text": "Add 2 "}, {"type": "text", "text": "and 3."}]
    client.chat.completions.create(model="models/tiny", messages=[{"role": "user", "content": parts}], max_tokens=2)
    joined = "Add 2 \nand 3."  # as vLLM joins text parts for a string-content template
    plain = codec.encode(codec.render_chat([{"role": "user", "content": joined}]), add_special_tokens=False)
    assert router.submitted[0].prompt_token_ids == plain
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="models/tiny", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}])
    assert e.value.body["param"] == "messages[0].content[0]"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="models/tiny", max_tokens=2, messages=[{"role": "user", "content": "x"}],
                                       extra_body={"chat_template": "{{ messages }}"})
    assert e.value.body["param"] == "chat_template"


def test_trl_chat_takes_a_batch_of_conversations(http, codec):
    convs = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Add 2 and 3."}]]
    body = http.post("/chat/", json={"messages": convs, "n": 3, "max_tokens": 2}, headers=AUTH).json()
    assert body["prompt_ids"] == [codec.encode(codec.render_chat(c), add_special_tokens=False) for c in convs]
    assert len(body["completion_ids"]) == 6


@pytest.mark.parametrize("body, field", [
    ({"prompts": ["x"], "temperature": "hot"}, "temperature"),
    ({"prompts": ["x"], "generation_kwargs": {"beam_width": 2}}, "generation_kwargs.beam_width"),
    ({"prompts": ["x"], "logprobs": 3}, "logprobs"),
    ({"prompts": ["x"], "top_p": 0}, "top_p"),
    ({"prompt": ["x"]}, "prompts"),
    ({"prompts": ["x"], "min_p": -0.1}, "min_p"),
])
def test_trl_bad_fields_are_422_naming_them(http, body, field):
    answer = http.post("/generate/", json=body, headers=AUTH)
    assert answer.status_code == 422, answer.text
    assert field in json.dumps(answer.json()["detail"])


def test_server_info_answers_what_trl_reads(http):
    info = http.get("/server_info", params={"config_format": "json"}, headers=AUTH).json()["vllm_config"]
    assert info["model_config"]["logprobs_mode"] == "raw_logprobs" and info["model_config"]["max_model_len"] == 4096
    assert info["weight_transfer_config"] is None
    assert http.get("/server_info").status_code == 401
    # without security.http_weight_updates the Gateway has no relay, and no weight route
    assert http.post("/init_communicator/", headers=AUTH, json={}).status_code == 404
    assert http.post("/update_weights", headers=AUTH, json={}).status_code == 404


def test_trl_health_world_size_and_prefix_cache(http, router):
    assert http.get("/health/").json() == {"status": "ok"}
    # the weight relay is the one rank a trainer's group needs, whatever the fleet's size (2 here)
    assert http.get("/get_world_size/", headers=AUTH).json() == {"world_size": 1}
    assert http.get("/get_world_size", headers=AUTH).json() == {"world_size": 1}
    assert http.post("/reset_prefix_cache", headers=AUTH).json() == {"success": True}
    assert "True" in http.post("/reset_prefix_cache/", headers=AUTH).json()["message"]
    assert router.resets == 2
    assert http.post("/reset_prefix_cache").status_code == 401


class Commits:
    def __init__(self):
        self.named = []

    def __call__(self, named: list) -> int:
        self.named.append(dict(named))
        return len(self.named)


@pytest.fixture
def relay_http(router, codec):
    from rollout_cluster.serve.protocols.trl_weights import RelayRunner
    from rollout_cluster.transfer.relay import WeightRelay

    commits = Commits()
    runner = RelayRunner(WeightRelay({"w.weight": (2, 3), "b.bias": (4,)}, commits, "cpu", timeout_s=20))
    ctx = ProtocolContext(router, codec, LimitsConfig(), 5.0, model_name="models/tiny", model_root="/m/tiny",
                          world_size=1)
    return TestClient(gateway_app(router, {}, 5.0, TOKEN, LimitsConfig(), ctx, runner)), commits


def announced_while_broadcast(sender, named: dict, announce, shapes=None) -> tuple:
    """As TRL >= 1.11's client: `announce(update_info)` (the /update_weights step) while the
    trainer broadcasts `named` on another thread; (what announce returned, or the exception it
    raised; the broadcast's error or None). The broadcast is bounded by a join timeout."""
    import threading

    out = {}

    def broadcast():
        try:
            for x in named.values():
                sender.send(x)
        except Exception as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=broadcast, daemon=True)
    t.start()
    info = {"names": list(named), "dtype_names": ["float32"] * len(named),
            "shapes": shapes or [list(x.shape) for x in named.values()], "packed": False}
    try:
        answer = announce(info)
    except Exception as e:  # noqa: BLE001 - handed to the test
        answer = e
    t.join(20)
    assert not t.is_alive(), "the trainer's broadcast never ended"
    return answer, out.get("error")


def vllm_group(http, timeout_s: float):
    """The trainer's side of vLLM's weight-transfer group (it hosts, as rank 0), joined by the
    relay through /init_weight_transfer_engine: the stand-in for TRL >= 1.11's NCCL sender."""
    from rollout_cluster.transfer.channels import CpuSender

    port = free_port()
    sender = CpuSender("127.0.0.1", port, 2, hosts_store=True, timeout_s=timeout_s)
    r = http.post("/init_weight_transfer_engine", headers=AUTH, json={"init_info": {
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}})
    assert r.status_code == 200, r.text
    return sender


def test_trl_legacy_weight_routes_relay_an_update_before_the_prefix_cache_reset(relay_http, router):
    import torch

    from rollout_cluster.transfer.channels import CpuSender

    http, commits = relay_http
    info = http.get("/server_info", headers=AUTH).json()["vllm_config"]
    assert info["weight_transfer_config"] == {"backend": "cpu"}
    port = free_port()
    r = http.post("/init_communicator/", headers=AUTH,
                  json={"host": "0.0.0.0", "port": port, "world_size": 2, "client_device_uuid": "cpu"})
    assert r.status_code == 200, r.text
    sender = CpuSender("127.0.0.1", port, 2, hosts_store=False, timeout_s=20)
    new = {"w.weight": torch.randn(2, 3), "b.bias": torch.randn(4)}
    for name, t in new.items():  # as TRL's update_named_param: the POST's answer, then the broadcast
        r = http.post("/update_named_param/", headers=AUTH,
                      json={"name": name, "dtype": str(t.dtype), "shape": list(t.shape)})
        assert r.status_code == 200, r.text
        sender.send(t)
    assert "True" in http.post("/reset_prefix_cache/", headers=AUTH).json()["message"]
    assert len(commits.named) == 1 and all(torch.equal(commits.named[0][k], v) for k, v in new.items())
    assert router.resets == 1
    assert http.post("/close_communicator/", headers=AUTH).status_code == 200


@pytest.mark.parametrize("route, body, field", [
    ("/init_communicator/", {"host": "0.0.0.0", "port": 5000, "world_size": 3}, "world_size"),
    ("/init_communicator/", {"host": "0.0.0.0", "world_size": 2}, "port"),
    ("/update_named_param/", {"name": "nope", "dtype": "torch.float32", "shape": [2, 3]}, "name"),
    ("/update_named_param/", {"name": "w.weight", "dtype": "torch.int64", "shape": [2, 3]}, "dtype"),
    ("/update_named_param/", {"name": "w.weight", "dtype": "torch.float32", "shape": [3, 2]}, "shape"),
    ("/init_weight_transfer_engine", {"init_info": {"master_address": "127.0.0.1", "master_port": 5000,
                                                    "rank_offset": 1, "world_size": 3}}, "init_info.world_size"),
    ("/start_weight_update", {}, "communicator"),
    ("/update_weights", {"update_info": {"names": ["w.weight"]}}, "communicator"),
])
def test_weight_routes_refuse_a_bad_field_with_422_naming_it(relay_http, route, body, field):
    http, commits = relay_http
    r = http.post(route, headers=AUTH, json=body)
    assert r.status_code == 422, r.text
    assert r.json()["detail"][0]["loc"] == ["body", field]
    assert commits.named == []
    assert http.post(route, json=body).status_code == 401  # the token, as every route


def test_a_retried_update_named_param_queues_no_second_receive(relay_http, router):
    """Regression: TRL's client retries a POST whose answer was lost; the retried
    /update_named_param/ queued a second receive of the tensor, which the trainer sends once, so
    the receive took the next tensor's bytes (or waited until the channel's timeout) and the
    update failed at /reset_prefix_cache/."""
    import torch

    from rollout_cluster.transfer.channels import CpuSender

    http, commits = relay_http
    port = free_port()
    body = {"host": "0.0.0.0", "port": port, "world_size": 2, "client_device_uuid": "cpu"}
    for _ in range(2):  # the second is the first retried: the group opens once
        assert http.post("/init_communicator/", headers=AUTH, json=body).status_code == 200
    sender = CpuSender("127.0.0.1", port, 2, hosts_store=False, timeout_s=20)
    new = {"w.weight": torch.randn(2, 3), "b.bias": torch.randn(4)}
    for name, t in new.items():
        for _ in range(2):  # the answer lost, the request retried: both answered 200
            r = http.post("/update_named_param/", headers=AUTH,
                          json={"name": name, "dtype": str(t.dtype), "shape": list(t.shape)})
            assert r.status_code == 200, r.text
        sender.send(t)  # once, as the trainer does
    r = http.post("/reset_prefix_cache/", headers=AUTH)
    assert r.status_code == 200 and "True" in r.json()["message"], r.text
    assert len(commits.named) == 1 and all(torch.equal(commits.named[0][k], v) for k, v in new.items())
    assert http.post("/close_communicator/", headers=AUTH).status_code == 200


def test_retried_update_weights_and_finish_answer_as_the_first_did(relay_http):
    """Regression: a retried /update_weights waited for tensors the trainer had sent already (and
    failed at the channel's timeout); a retried /finish_weight_update answered no version."""
    import threading

    import torch

    http, commits = relay_http
    sender = vllm_group(http, timeout_s=20)
    new = {"w.weight": torch.randn(2, 3), "b.bias": torch.randn(4)}
    info = {"names": list(new), "dtype_names": ["float32"] * 2, "shapes": [[2, 3], [4]], "packed": False}
    assert http.post("/start_weight_update", headers=AUTH, json={}).status_code == 200
    t = threading.Thread(target=lambda: [sender.send(x) for x in new.values()])
    t.start()
    assert http.post("/update_weights", headers=AUTH, json={"update_info": info}).status_code == 200
    t.join(20)
    r = http.post("/update_weights", headers=AUTH, json={"update_info": info})  # retried: nothing more to receive
    assert r.status_code == 200, r.text
    answers = [http.post("/finish_weight_update", headers=AUTH, json={}) for _ in range(2)]
    assert [a.json() for a in answers] == [{"message": "Weight update finished", "version": 1}] * 2
    assert len(commits.named) == 1 and all(torch.equal(commits.named[0][k], v) for k, v in new.items())
    assert http.post("/shutdown_weight_transfer_engine", headers=AUTH).status_code == 200


def test_a_dummy_weight_model_bounds_announced_shapes_by_its_config(router, codec, tmp_path):
    """Regression: without safetensors files (load_format dummy) the relay took any shape, so a
    trainer could make it allocate any size; the config's meta-built model now names the shapes."""
    from transformers import LlamaConfig

    from rollout_cluster.serve.protocols.trl_weights import relay_runner

    LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, vocab_size=64).save_pretrained(tmp_path)  # config.json only
    runner = relay_runner(router, str(tmp_path), 5.0)
    ctx = ProtocolContext(router, codec, LimitsConfig(), 5.0, model_name="m", model_root=str(tmp_path), world_size=1)
    http = TestClient(gateway_app(router, {}, 5.0, TOKEN, LimitsConfig(), ctx, runner))
    for body, field in (({"name": "model.norm.weight", "dtype": "torch.float32", "shape": [1 << 40]}, "shape"),
                        ({"name": "model.huge", "dtype": "torch.float32", "shape": [4]}, "name")):
        r = http.post("/update_named_param/", headers=AUTH, json=body)
        assert r.status_code == 422 and r.json()["detail"][0]["loc"] == ["body", field], r.text
        assert body["name"] in r.json()["detail"][0]["msg"]


def test_a_refused_update_weights_takes_the_trainers_broadcast_so_the_trainer_hears_the_422(relay_http):
    """Regression: TRL >= 1.11 posts /update_weights and broadcasts the announced tensors at the
    same time; a 422 answered before they arrived left the trainer blocked in its broadcast
    (until its group's timeout; NCCL's never ends). The relay now takes the refused tensors,
    drops them, then answers 422 naming the field, and the group stays usable."""
    import torch

    http, commits = relay_http
    sender = vllm_group(http, timeout_s=8)
    assert http.post("/start_weight_update", headers=AUTH, json={}).status_code == 200

    def update(named: dict) -> tuple:
        """As TRL's client: the POST and the broadcast at once; (answer, the trainer's error)."""
        return announced_while_broadcast(
            sender, named, lambda info: http.post("/update_weights", headers=AUTH, json={"update_info": info}))

    answer, error = update({"w.weight": torch.randn(2, 3), "model.lora_A.weight": torch.randn(4, 4)})
    assert error is None  # the trainer's broadcast completed
    assert answer.status_code == 422 and answer.json()["detail"][0]["loc"] == ["body", "update_info.names[1]"]
    assert "model.lora_A.weight" in answer.json()["detail"][0]["msg"]
    # the refused update is failed whole (TRL's weight_update() block finishes it all the same)
    failed = http.post("/finish_weight_update", headers=AUTH, json={})
    assert failed.status_code != 200 and "model.lora_A.weight" in failed.text, failed.text
    assert http.post("/start_weight_update", headers=AUTH, json={}).status_code == 200
    new = {"w.weight": torch.randn(2, 3), "b.bias": torch.randn(4)}
    answer, error = update(new)  # the group still lines up: the next update arrives whole
    assert error is None and answer.status_code == 200, answer.text
    assert http.post("/finish_weight_update", headers=AUTH, json={}).json()["version"] == 1
    assert len(commits.named) == 1 and all(torch.equal(commits.named[0][k], v) for k, v in new.items())
    assert http.post("/shutdown_weight_transfer_engine", headers=AUTH).status_code == 200
