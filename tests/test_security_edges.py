"""Security at its edges (rollout_cluster/security/, the router's credential check, the Gateway's
token): a foreign key in the nonce journal's namespace erases no nonce, a forged credential that
cannot encode is refused and counted, a '#' inside a key is refused, a token no Bearer header can
carry is refused when read, each refusal names the field and value it is about. In-process only."""
import re
import time

import pytest
from starlette.testclient import TestClient

from rollout_cluster.config import LimitsConfig, SecurityConfig
from rollout_cluster.protocol import Report
from rollout_cluster.security.nonce_journal import attach
from rollout_cluster.security.secrets import SecretError, read_keys, read_token
from rollout_cluster.security.signing import OrderRefused, OrderVerifier, SignedOrder, Signer
from rollout_cluster.serve.gateway import gateway_app
from rollout_cluster.serve.router_credentials import ReplicaCredentials

KEYS = {"k1": b"s" * 40}
SKEW = 30.0


class DictKV:
    """The journal's store (Ray's GCS in production) as a set of keys."""

    def __init__(self):
        self.data = set()

    def put(self, key):
        self.data.add(key)

    def keys(self):
        return sorted(self.data)

    def delete(self, key):
        self.data.discard(key)


def _router_verifier(kv, now_s, warnings):
    v = OrderVerifier(dict(KEYS), SKEW)
    attach(v, kv, int(now_s * 1000), warnings.append)
    return v


def _signed(op, args, at_s):
    return Signer(dict(KEYS), clock=lambda: at_s).sign(op, args)


# ---- nonce_journal.py ----------------------------------------------------------------------------
@pytest.mark.parametrize("foreign", ["\u00b2:x", "\u00b9\u00b2:" + "a" * 32])
def test_a_foreign_key_in_the_journal_namespace_does_not_erase_every_nonce_it_holds(foreign):
    """nonce_journal._parse treats a key as ours when its part before ':' passes str.isdigit(), then
    calls int() on it. Superscript digits ('²') pass isdigit() and int() refuses them (the same trap
    http_body._declares_more documents), so recall() raises ValueError on such a key; attach() warns
    and the restarted router remembers NONE of its predecessor's nonces: an order captured before the
    restart runs again. Right: a key that does not parse is 'not ours: left alone' (as the comment
    in recall() says) and every other nonce is still recalled, so the replay is refused."""
    kv, warnings = DictKV(), []
    first = _router_verifier(kv, 1000.0, warnings)
    order = _signed("set_trace", {"on": True}, 1000.0)
    assert first.check(order, "set_trace", 1000.0) == {"on": True}
    kv.data.add(foreign)  # someone else's key in the namespace
    second = _router_verifier(kv, 1005.0, warnings)  # Serve restarted the router 5 s later
    try:
        second.check(order, "set_trace", 1005.0)
    except OrderRefused as e:
        assert e.reason == "replay", warnings
    else:
        pytest.fail(f"the captured order ran again after the restart; the router warned: {warnings}")
    assert foreign in kv.data  # left alone


# ---- router_credentials.py -----------------------------------------------------------------------
class _Metrics:
    def __init__(self):
        self.reasons = []

    def refused(self, reason):
        self.reasons.append(reason)


def test_a_forged_report_credential_with_a_lone_surrogate_is_refused_and_counted_not_raised():
    """ReplicaCredentials.known compares `given.encode()` with the issued credential: a forged
    report whose credential holds a lone UTF-16 surrogate ('\\ud800', which pickles through Ray)
    raises UnicodeEncodeError out of Router.pull instead of being refused: it is not counted as
    `report_credential` in status()["control"] nor in rollout_control_refusals_total (the same
    escape signing.py closed for signatures with surrogatepass; tests/test_signing_non_ascii.py).
    Right: known() returns False and counts one `report_credential` refusal."""
    verifier, metrics = OrderVerifier(dict(KEYS)), _Metrics()
    creds = ReplicaCredentials(verifier, metrics)
    creds.register({"replica_id": "a", "incarnation": "a-1"})
    forged = Report("a", "a-1", credential="\ud800" * 32)
    assert creds.known(forged) is False
    assert verifier.refusals["report_credential"] == 1 and metrics.reasons == ["report_credential"]


# ---- secrets.py ------------------------------------------------------------------------------------
def test_a_hash_inside_a_control_key_is_not_silently_cut_off(tmp_path):
    """read_keys strips everything from the first '#' on each line, even in the middle of the
    secret: `k1 <33 chars>#<20 chars>` silently becomes a 33-character key (it still passes the
    32-character minimum). The file is accepted, the key is weaker than the one written, and a
    signer in another language (docs/security.md: 'Any language can produce it') that takes the
    line's secret as written signs with another key: every order of it is `bad_signature`.
    Right: a '#' glued to the secret is part of it (a comment starts at a '#' after whitespace),
    or the file is refused naming the key id; never a silently shortened key."""
    secret = "A" * 33 + "#" + "B" * 20
    f = tmp_path / "control-keys"
    f.write_text(f"k1 {secret}\n")
    try:
        keys = read_keys(SecurityConfig(control_keys_file=str(f)))
    except SecretError as e:
        assert secret not in str(e)
        return
    assert keys == {"k1": secret.encode()}


@pytest.mark.parametrize("token", ["\ufeff" + "x" * 32, "\u00e9" * 20 + "-token"],
                         ids=["utf8-bom", "non-ascii"])
def test_a_token_no_bearer_header_can_present_is_refused_when_read(tmp_path, token):
    """read_token accepts any one-word token of 16+ characters, including a file that starts with a
    UTF-8 byte-order mark (an editor's; `open(encoding="utf-8")` keeps it, and str.strip() does not
    remove it) or a token with non-ASCII characters. HTTP header values reach Starlette as latin-1,
    so `Authorization: Bearer <token>` (the bytes `$(cat token)` gives curl, BOM included) never
    equals the token read: the Gateway starts and answers 401 to every Bearer request, with no
    error anywhere. Right: read_token refuses such a token naming the file (printable ASCII only),
    or the Gateway accepts the Bearer header that carries exactly the file's bytes."""
    f = tmp_path / "token"
    f.write_text(token + "\n", encoding="utf-8")
    try:
        read = read_token(SecurityConfig(token_file=str(f)))
    except SecretError as e:
        assert str(f) in str(e) and token not in str(e)
        return
    g = TestClient(gateway_app(object(), {}, 5.0, read, LimitsConfig()))
    answer = g.get("/no-such-route", headers={"Authorization": b"Bearer " + f.read_bytes().strip()})
    assert answer.status_code == 404, "the token file's own bytes as a Bearer token are refused (401)"


def test_an_unreadable_token_file_named_by_the_variable_is_said_to_come_from_the_variable(tmp_path, monkeypatch):
    """secrets._read follows $ROLLOUT_TOKEN_FILE by calling itself with the variable's path but the
    same `what`, so the error says 'security.token_file: cannot read file ...' for a config whose
    token_file is empty: it names the wrong setting (the operator looks at the config, where there is
    nothing to fix). Right: the message names the variable it came from ($ROLLOUT_TOKEN_FILE)."""
    monkeypatch.setenv("ROLLOUT_TOKEN_FILE", str(tmp_path / "nope"))
    with pytest.raises(SecretError) as e:
        read_token(SecurityConfig())
    assert "ROLLOUT_TOKEN_FILE" in str(e.value), str(e.value)


# ---- signing.py: what a refusal says --------------------------------------------------------------
@pytest.mark.parametrize("bad, named", [
    (dict(issued_ms=1.5), "issued_ms=1.5"),
    (dict(nonce="not-hex"), "nonce='not-hex'"),
    (dict(key_id=7), "key_id=7"),
    (dict(args={"level": float("nan")}), "level"),
], ids=["issued_ms", "nonce", "key_id", "args"])
def test_a_malformed_order_refusal_names_the_field_and_its_value(bad, named):
    """Every `malformed` refusal says the same sentence, 'op, args, issued_ms, nonce (32 hex digits),
    key_id, signature' (or 'args must be plain JSON'), whatever was wrong: the caller (a non-Python
    signer, docs/security.md) and the router's log cannot tell which field, or which argument, broke.
    Right: the message names the field and its value (bounded, as wrong_op's op[:40] is), e.g.
    `issued_ms=1.5: must be an integer`, or the argument that is not plain JSON."""
    fields = dict(op="sleep", args={"level": 1}, issued_ms=int(time.time() * 1000), nonce="0" * 32,
                  key_id="k1", signature="")
    fields.update(bad)
    with pytest.raises(OrderRefused) as e:
        OrderVerifier(dict(KEYS)).check(SignedOrder(**fields), "sleep", time.time())
    assert e.value.reason == "malformed"
    assert named in str(e.value), str(e.value)


def test_a_skew_refusal_at_the_edge_does_not_say_it_was_within_the_limit():
    """The skew refusal rounds the skew to whole seconds ('issued {skew:.0f} s'), so an order 30.4 s
    off with max_clock_skew_s 30 is refused with 'issued 30 s from the router's clock (at most
    security.max_clock_skew_s=30)': the message contradicts the refusal exactly where clocks are
    being debugged. Right: the skew shown is the one compared (e.g. 30.4 s), larger than the limit."""
    now = 1_000_000.0
    order = _signed("wake", {}, now + 30.4)
    with pytest.raises(OrderRefused) as e:
        OrderVerifier(dict(KEYS), SKEW).check(order, "wake", now)
    assert e.value.reason == "skew"
    shown = float(re.search(r"issued ([0-9.]+) s", str(e.value)).group(1))
    assert shown > SKEW, str(e.value)
