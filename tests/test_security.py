"""The front door's parts without Ray: secrets, signed orders, checkpoint roots, the replica
credential, the Gateway's token and limits, the router's batch limits."""
import asyncio
import json
import os
import stat
import time

import pytest
from starlette.testclient import TestClient

from rollout_cluster.config import ClusterConfig, LimitsConfig, SecurityConfig, to_dict
from rollout_cluster.protocol import (InputError, LimitExceeded, Orders, Report, RouterBusy, SamplingSpec,
                                      SequenceRequest)
from rollout_cluster.router.limits import BatchLimits
from rollout_cluster.security.local import ensure_local_secrets
from rollout_cluster.security.paths import PathRefused, check_under_roots
from rollout_cluster.security.secrets import SecretError, read_keys, read_token
from rollout_cluster.security.signed_router import SignedRouter
from rollout_cluster.security.signing import OrderRefused, OrderVerifier, SignedOrder, Signer, canonical
from rollout_cluster.serve.gateway import gateway_app
from router_support import order, pull
from test_partial_rollouts import CuttingRouter

KEY_A, KEY_B = "a" * 40, "b" * 40
TOKEN = "t0ken-" + "x" * 30


# ---- secrets --------------------------------------------------------------------------------------
def test_the_token_comes_from_the_file_then_the_file_variable_then_the_variable(tmp_path, monkeypatch):
    f = tmp_path / "token"
    f.write_text(TOKEN + "\n")
    monkeypatch.delenv("ROLLOUT_TOKEN", raising=False)
    assert read_token(SecurityConfig()) is None
    monkeypatch.setenv("ROLLOUT_TOKEN", "from-the-variable-123456")
    assert read_token(SecurityConfig()) == "from-the-variable-123456"
    monkeypatch.setenv("ROLLOUT_TOKEN_FILE", str(f))
    assert read_token(SecurityConfig()) == TOKEN
    assert read_token(SecurityConfig(token_file=str(f), token_env="")) == TOKEN


@pytest.mark.parametrize("text", ["short", "two words-0123456789", ""])
def test_a_weak_or_malformed_token_is_refused_without_showing_it(tmp_path, text):
    f = tmp_path / "token"
    f.write_text(text)
    with pytest.raises(SecretError) as e:
        read_token(SecurityConfig(token_file=str(f)))
    assert str(f) in str(e.value) and (not text or text not in str(e.value))


def test_a_missing_token_file_is_named(tmp_path):
    with pytest.raises(SecretError, match="cannot read file .*nope"):
        read_token(SecurityConfig(token_file=str(tmp_path / "nope")))


def test_keys_parse_in_order_with_comments_and_at_most_two(tmp_path):
    f = tmp_path / "keys"
    f.write_text(f"# rotation: new first\nnew {KEY_A}\nold {KEY_B}  # retiring\n")
    assert list(read_keys(SecurityConfig(control_keys_file=str(f))).items()) == [("new", KEY_A.encode()),
                                                                                  ("old", KEY_B.encode())]
    assert read_keys(SecurityConfig(control_keys_file="", control_keys_env="NO_SUCH_VARIABLE_X")) == {}
    for text, said in [(f"a {KEY_A}\nb {KEY_B}\nc {KEY_A}", "at most 2"), (f"a {KEY_A}\na {KEY_B}", "given twice"),
                       ("a tooshort", "at least 32"), (KEY_A, "key_id secret"), ("# nothing", "holds no key")]:
        f.write_text(text)
        with pytest.raises(SecretError, match=said) as e:
            read_keys(SecurityConfig(control_keys_file=str(f)))
        assert KEY_A not in str(e.value) and KEY_B not in str(e.value)


def test_local_secrets_are_made_once_readable_by_their_owner_only(tmp_path, monkeypatch):
    monkeypatch.delenv("ROLLOUT_TOKEN", raising=False)
    monkeypatch.delenv("ROLLOUT_CONTROL_KEYS", raising=False)
    cfg = ClusterConfig(base_dir=str(tmp_path))
    made = ensure_local_secrets(cfg)
    assert sorted(made) == sorted([str(tmp_path / ".secrets" / "token"), str(tmp_path / ".secrets" / "control-keys")])
    for path in made:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    token, keys = read_token(cfg.security), read_keys(cfg.security)
    assert len(token) >= 32 and len(keys) == 1
    again = ClusterConfig(base_dir=str(tmp_path))
    assert ensure_local_secrets(again) == [] and read_token(again.security) == token  # the same, not remade
    # a configured secret (here: the variable) is used as it is; nothing is made for it
    monkeypatch.setenv("ROLLOUT_CONTROL_KEYS", f"env {KEY_A}")
    other = ClusterConfig(base_dir=str(tmp_path / "other"))
    assert ensure_local_secrets(other) == [str(tmp_path / "other" / ".secrets" / "token")]
    assert other.security.control_keys_file == ""


# ---- signed orders --------------------------------------------------------------------------------
def test_a_signed_order_passes_once_and_every_kind_of_bad_one_is_refused_by_reason():
    keys = {"k1": KEY_A.encode()}
    v, s, now = OrderVerifier(keys), Signer(keys), time.time()
    good = s.sign("sleep", {"level": 1})
    assert v.check(good, "sleep", now) == {"level": 1}
    tampered = SignedOrder(good.op, {"level": 2}, good.issued_ms, "f" * 32, good.key_id, good.signature)
    cases = [(good, "sleep", now, "replay"),
             (s.sign("sleep", {"level": 1}), "wake", now, "wrong_op"),
             (tampered, "sleep", now, "bad_signature"),
             (Signer({"k9": KEY_A.encode()}).sign("wake", {}), "wake", now, "unknown_key"),
             (Signer({"k1": KEY_B.encode()}).sign("wake", {}), "wake", now, "bad_signature"),
             (Signer().sign("wake", {}), "wake", now, "unsigned"),
             ("wake", "wake", now, "unsigned"),
             (SignedOrder("wake", {}, 1.5, "0" * 32, "k1", ""), "wake", now, "malformed"),
             (SignedOrder("wake", {}, 1, "not-hex", "k1", ""), "wake", now, "malformed"),
             (SignedOrder("sleep", {"level": float("nan")}, 1, "0" * 32, "k1", ""), "sleep", now, "malformed"),
             (s.sign("wake", {}), "wake", now + 31, "skew"),
             (s.sign("wake", {}), "wake", now - 31, "skew")]
    for o, op, at, reason in cases:
        with pytest.raises(OrderRefused) as e:
            v.check(o, op, at)
        assert e.value.reason == reason, (o, op)
    assert v.accepted == 1 and sum(v.refusals.values()) == len(cases)
    assert v.refusals["skew"] == 2 and v.refusals["unsigned"] == 2 and v.refusals["bad_signature"] == 2


def test_two_keys_verify_during_a_rotation_and_a_removed_key_stops_working():
    old, new = Signer({"old": KEY_A.encode()}), Signer({"new": KEY_B.encode()})
    both = OrderVerifier({"new": KEY_B.encode(), "old": KEY_A.encode()})
    now = time.time()
    assert both.check(old.sign("wake", {}), "wake", now) == {} and both.check(new.sign("wake", {}), "wake", now) == {}
    after = OrderVerifier({"new": KEY_B.encode()})
    with pytest.raises(OrderRefused) as e:
        after.check(old.sign("wake", {}), "wake", now)
    assert e.value.reason == "unknown_key"


def test_nonces_are_forgotten_once_their_orders_would_be_refused_for_skew_anyway():
    keys = {"k": KEY_A.encode()}
    clock = [1000.0]
    s, v = Signer(keys, clock=lambda: clock[0]), OrderVerifier(keys, max_skew_s=30)
    for _ in range(100):
        v.check(s.sign("wake", {}), "wake", clock[0])
    assert len(v._nonces) == 100
    clock[0] += 61
    v.check(s.sign("wake", {}), "wake", clock[0])
    assert len(v._nonces) == 1


def test_the_router_refuses_to_start_without_a_key_unless_told_to():
    with pytest.raises(ValueError, match="allow_unsigned_control"):
        OrderVerifier({})
    assert OrderVerifier({}, allow_unsigned=True).check(Signer().sign("wake", {}), "wake", time.time()) == {}


def test_canonical_form_is_compact_sorted_json():
    assert canonical("x", {"b": 1, "a": [2]}, 5, "n", "k") == b'["x",{"a":[2],"b":1},5,"n","k"]'


def test_the_signed_handle_signs_control_calls_by_argument_name_and_passes_the_rest():
    sent = []

    class Method:
        def __init__(self, name):
            self.name = name

        def remote(self, *args, **kwargs):
            sent.append((self.name, args, kwargs))

    class Handle:
        def __getattr__(self, name):
            return Method(name)

    r = SignedRouter(Handle(), Signer({"k": KEY_A.encode()}))
    r.update_weights.remote("/ckpt", 3)
    r.cancel.remote(batch_id="b1")
    r.fetch.remote("b1", 0, 1.0)
    (op1, (o1,), _), (op2, (o2,), _), fetch = sent
    assert (op1, o1.op, o1.args) == ("update_weights", "update_weights", {"path": "/ckpt", "version": 3})
    assert (o2.op, o2.args) == ("cancel", {"batch_id": "b1"}) and o1.nonce != o2.nonce
    assert fetch == ("fetch", ("b1", 0, 1.0), {})
    with pytest.raises(TypeError, match="at most 1"):
        r.sleep.remote(1, 2)
    with pytest.raises(ValueError, match="Out of range float|JSON"):
        r.sleep.remote(float("nan"))


# ---- checkpoint roots -----------------------------------------------------------------------------
def test_update_paths_must_resolve_under_a_checkpoint_root(tmp_path):
    root, outside = tmp_path / "ckpts", tmp_path / "elsewhere"
    (root / "step-1").mkdir(parents=True)
    outside.mkdir()
    (root / "link").symlink_to(outside)
    assert check_under_roots(str(root / "step-1"), [str(root)]) == str((root / "step-1").resolve())
    for path in [str(outside), str(root / ".." / "elsewhere"), str(root / "link"), str(tmp_path / "ckpts-evil"), ""]:
        with pytest.raises(PathRefused):
            check_under_roots(path, [str(root)])
    with pytest.raises(PathRefused, match="no checkpoint roots are configured"):
        check_under_roots(str(root / "step-1"), [])


def test_relative_roots_and_secret_files_resolve_against_the_config_folder(tmp_path):
    cfg = ClusterConfig(base_dir=str(tmp_path), security={"checkpoint_roots": ["ckpts"], "token_file": "s/token"})
    assert cfg.security.checkpoint_roots == [str(tmp_path / "ckpts")]
    assert cfg.security.token_file == str(tmp_path / "s" / "token")


# ---- the Serve Router: credentials, signed orders, roots -------------------------------------------
def _router(tmp_path, **security):
    from rollout_cluster.serve.router import Router

    cfg = ClusterConfig(replicas=1, engine={"kind": "sim"},
                        security={"checkpoint_roots": [str(tmp_path)], **security})
    return Router.func_or_class(to_dict(cfg))


def _report(rid="a", **kw):
    from rollout_cluster.protocol import EngineStats, ModelInfo

    return Report(rid, rid + "-1", stats=EngineStats(), model=ModelInfo(100, 64), capacity=4, **kw)


def test_a_report_without_its_credential_is_not_applied_and_the_replica_registers_again(tmp_path):
    async def go():
        router = _router(tmp_path)
        try:
            assert (await router.pull(_report())).register  # never registered: nothing applied
            assert not router.core.fleet.replicas
            orders = await pull(router, _report())  # registered, then applied
            assert not orders.register and "a" in router.core.fleet.replicas
            forged = _report()
            forged.credential = "0" * 32
            assert (await router.pull(forged)).register
            # only the forgery counts: a replica this router does not know yet (it restarted) is asked to register
            assert router.verifier.refusals["report_credential"] == 1
            assert router.metrics.registry.get_sample_value("rollout_control_refusals_total",
                                                            {"reason": "report_credential"}) == 1
        finally:
            router._reaper.cancel()

    asyncio.run(go())


def test_update_weights_needs_a_signed_order_and_a_path_under_the_roots(tmp_path):
    async def go():
        router = _router(tmp_path)
        try:
            await pull(router, _report())
            with pytest.raises(OrderRefused):
                await router.update_weights(Signer().sign("update_weights", {"path": str(tmp_path), "version": 1}))
            with pytest.raises(PathRefused):
                await router.update_weights(order("update_weights", path="/etc", version=1))
            (tmp_path / "step-1").mkdir()
            assert await router.update_weights(order("update_weights", path=str(tmp_path / "step-1"), version=1)) == 1
            assert router.core.weights.path == str((tmp_path / "step-1").resolve())
            st = await router.status()
            # accepted: orders whose signature held (the register, the one refused for its path, the load)
            assert st["control"] == {"accepted": 3, "refused": {"unsigned": 1, "path": 1}}
        finally:
            router._reaper.cancel()

    asyncio.run(go())


def test_batch_ids_are_unguessable_and_the_live_limit_refuses_with_router_busy(tmp_path):
    async def go():
        from rollout_cluster.serve.router import Router

        cfg = ClusterConfig(replicas=1, engine={"kind": "sim"}, limits={"max_live_sequences": 3, "max_batch_sequences": 3})
        router = Router.func_or_class(to_dict(cfg))
        try:
            await pull(router, _report())
            reqs = [SequenceRequest([1, 2], SamplingSpec(max_tokens=4), i, 0) for i in range(2)]
            a = await router.submit(reqs, wait_for_replica_s=1)
            b = await router.submit(reqs[:1], wait_for_replica_s=1)
            assert len(a.rsplit("-", 1)[-1]) == 16 and a.rsplit("-", 1)[-1] != b.rsplit("-", 1)[-1]
            with pytest.raises(RouterBusy, match="limits.max_live_sequences=3"):
                await router.submit(reqs[:1], wait_for_replica_s=1)
            assert len(router.core.batches.live) == 2  # the refused batch registered nothing
        finally:
            router._reaper.cancel()

    asyncio.run(go())


def test_the_core_refuses_a_batch_past_its_size_and_a_sample_count_past_max_n():
    from rollout_cluster.config import PolicyConfig
    from rollout_cluster.engines.cost_model import load_profile
    from rollout_cluster.policy import make_policy
    from rollout_cluster.router.core import RouterCore
    from rollout_cluster.router.limits import BatchLimits

    core = RouterCore(make_policy(PolicyConfig(name="pull"), load_profile("a100-80g-7b")), 1,
                      limits=BatchLimits(max_n=2, max_batch_sequences=3))
    core.apply(_report(), 0.0)
    with pytest.raises(LimitExceeded, match="max_batch_sequences=3"):
        core.submit([SequenceRequest([1], SamplingSpec(max_tokens=2), i, 0) for i in range(4)], 0.0)
    bid = core.submit([SequenceRequest([1], SamplingSpec(max_tokens=2, n=3), 0, 0),
                       SequenceRequest([1], SamplingSpec(max_tokens=2, n=2), 1, 0)], 0.0)
    done, _, _ = core.fetch(bid, 0)
    assert [c.error for c in done] == ["n=3: at most limits.max_n=2 samples per prompt"]


def test_n_past_the_protocol_ceiling_is_refused_without_expanding():
    from rollout_cluster.client.expand import expand

    with pytest.raises(InputError, match="n=10000000: must be at most 65536"):
        SamplingSpec(n=10_000_000).validate()
    t0 = time.monotonic()
    assert len(expand([[1]], SamplingSpec(n=10_000_000))) == 1 and time.monotonic() - t0 < 1


# ---- the Gateway: token, bounded bodies, limits ---------------------------------------------------
def _gateway(router=None, **limits) -> TestClient:
    return TestClient(gateway_app(router or CuttingRouter(per_fetch=3), {}, 5.0, TOKEN, LimitsConfig(**limits)))


AUTH = {"Authorization": f"Bearer {TOKEN}"}
LINE = json.dumps({"prompt_token_ids": [5, 6], "max_tokens": 4}) + "\n"


def test_every_route_but_healthz_asks_for_the_token():
    g = _gateway()
    assert g.get("/healthz").text == "ok"
    for method, path in [("get", "/"), ("post", "/generate"), ("get", "/docs"), ("get", "/openapi.json"),
                         ("get", "/no-such-route")]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN},
                        {"Authorization": f"Basic {TOKEN}"}):
            answer = getattr(g, method)(path, headers=headers)
            assert answer.status_code == 401 and answer.headers["www-authenticate"] == "Bearer", (path, headers)
            assert TOKEN not in answer.text
    assert g.get("/openapi.json", headers=AUTH).status_code == 200
    answer = g.post("/generate", content=LINE.encode(), headers=AUTH)
    assert answer.status_code == 200 and json.loads(answer.text)["finish_reason"] == "length"


def test_bodies_past_the_byte_limit_are_refused_declared_or_streamed():
    g = _gateway(max_body_bytes=1024)
    big = (LINE * 100).encode()
    answer = g.post("/generate", content=big, headers=AUTH)
    assert answer.status_code == 413 and "limits.max_body_bytes=1024" in answer.json()["error"]

    def chunks():  # no Content-Length: read as a stream and stopped at the limit
        for _ in range(100):
            yield LINE.encode()

    answer = g.post("/generate", content=chunks(), headers=AUTH)
    assert answer.status_code == 413


def test_lines_samples_and_batch_size_limits_name_themselves():
    g = _gateway(max_lines=3, max_n=4, max_batch_sequences=6)
    answer = g.post("/generate", content=(LINE * 4).encode(), headers=AUTH)
    assert answer.status_code == 413 and "limits.max_lines=3" in answer.json()["error"]
    body = (json.dumps({"prompt_token_ids": [5], "max_tokens": 2, "n": 5}) + "\n" + LINE).encode()
    records = [json.loads(x) for x in g.post("/generate", content=body, headers=AUTH).text.splitlines()]
    assert records[0]["error"] == "n=5: at most limits.max_n=4 samples per prompt"
    assert records[1]["finish_reason"] == "length"
    body = "".join(json.dumps({"prompt_token_ids": [5], "max_tokens": 2, "n": 3}) + "\n" for _ in range(3)).encode()
    answer = g.post("/generate", content=body, headers=AUTH)
    assert answer.status_code == 413 and "limits.max_batch_sequences=6" in answer.json()["error"]


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "1e9"])
def test_timeouts_must_be_finite_and_in_range(value):
    answer = _gateway().post(f"/generate?timeout_s={value}", content=LINE.encode(), headers=AUTH)
    assert answer.status_code == 400 and answer.json()["error"].startswith("timeout_s=")


def test_a_full_router_answers_429_with_retry_after():
    class Full(CuttingRouter):
        def _submit(self, requests, *a, **kw):
            BatchLimits(max_live_sequences=4).check_batch(len(requests), live=4)

    answer = _gateway(Full(per_fetch=3), retry_after_s=7).post("/generate", content=LINE.encode(), headers=AUTH)
    assert answer.status_code == 429 and answer.headers["retry-after"] == "7"
    assert "max_live_sequences" in answer.json()["error"]


def test_the_gateway_refuses_to_start_without_a_token_unless_told_to(monkeypatch):
    from rollout_cluster.serve.gateway import http_token

    monkeypatch.delenv("ROLLOUT_TOKEN", raising=False)
    with pytest.raises(RuntimeError, match="allow_unauthenticated"):
        http_token(SecurityConfig())
    assert http_token(SecurityConfig(allow_unauthenticated=True)) is None
    monkeypatch.setenv("ROLLOUT_TOKEN", TOKEN)
    assert http_token(SecurityConfig()) == TOKEN


# ---- the replica's link: registers, and again after a router restart ------------------------------
def test_the_link_registers_first_and_again_when_the_router_forgets_it():
    from rollout_cluster.serve.router_link import NotRegistered, RouterLink

    calls, known = [], {"cred": None}

    class Handle:
        class register:  # noqa: N801 (a handle's method)
            @staticmethod
            async def remote(order):
                calls.append("register")
                known["cred"] = f"c{len(calls)}"
                return known["cred"]

        class pull:  # noqa: N801
            @staticmethod
            async def remote(report):
                calls.append("pull")
                return Orders(register=report.credential != known["cred"])

    link = RouterLink(SignedRouter(Handle(), Signer({"k": KEY_A.encode()})), "a", "a-1")

    async def go():
        await link.pull(_report())
        known["cred"] = "restarted"  # a new router: it knows no credential
        with pytest.raises(NotRegistered):
            await link.pull(_report())
        await link.pull(_report())

    asyncio.run(go())
    assert calls == ["register", "pull", "pull", "register", "pull"] and link.registrations == 2


def test_a_salted_batch_id_made_by_another_router_reads_as_lost_not_unknown():
    """Regression: a random suffix on batch ids made a restarted router answer KeyError instead of
    BatchLostError, and the driver did not resubmit."""
    from rollout_cluster.protocol import BatchLostError
    from rollout_cluster.router.batches import Batches

    old, new = Batches("r1aaaa-", lambda: "0123456789abcdef"), Batches("r2bbbb-", lambda: "fedcba9876543210")
    bid = old.open(1, 0.0, 0).batch_id
    assert bid == "r1aaaa-b0-0123456789abcdef"
    with pytest.raises(BatchLostError):
        new.fetch(bid, 0)
    with pytest.raises(KeyError, match="unknown batch") as e:
        new.fetch("r2bbbb-b7-0123456789abcdef", 0)
    assert not isinstance(e.value, BatchLostError)


def test_a_link_planted_where_a_secret_is_made_is_refused_not_written_through(tmp_path, monkeypatch):
    monkeypatch.delenv("ROLLOUT_TOKEN", raising=False)
    monkeypatch.delenv("ROLLOUT_CONTROL_KEYS", raising=False)
    (tmp_path / ".secrets").mkdir(mode=0o700)
    target = tmp_path / "elsewhere" / "stolen"
    (tmp_path / "elsewhere").mkdir()
    os.symlink(target, tmp_path / ".secrets" / "token")  # dangles: os.path.exists says False
    with pytest.raises(PermissionError, match=r"\.secrets/token: exists \(a link"):
        ensure_local_secrets(ClusterConfig(base_dir=str(tmp_path)))
    assert not target.exists()


def test_secrets_are_not_made_in_a_folder_others_may_write(tmp_path, monkeypatch):
    monkeypatch.delenv("ROLLOUT_TOKEN", raising=False)
    monkeypatch.delenv("ROLLOUT_CONTROL_KEYS", raising=False)
    folder = tmp_path / ".secrets"
    folder.mkdir()
    os.chmod(folder, 0o777)
    with pytest.raises(PermissionError, match=r"\.secrets is writable by its group or others \(mode 0777\)"):
        ensure_local_secrets(ClusterConfig(base_dir=str(tmp_path)))
    assert list(folder.iterdir()) == []
