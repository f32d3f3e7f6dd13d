"""k8s/README.md's operating advice as it would run: the "work stuck" alert, evaluated with
Prometheus' matching rules, fires in both cases it names; every driver example that sends a control
order signs it with the keys the pods mount (the Router refuses an unsigned one). (The RayService's
hub-named model and its tokenizer: test_codec_hub_model.py.)

Also checked against the manifests when this was written (tests/test_k8s.py keeps the CRD checks): every manifest against KubeRay's CRDs at
feeaf72 (tests/data/k8s-crds equals ray-project/kuberay's ray-operator/config/crd/bases/ there) and
against KubeRay's own Go validation (ValidateRayClusterSpec / RayJobSpec / RayServiceSpec);
serveConfigV2 against Ray 2.60's ServeDeploySchema and our builder (import path, args, the
EngineReplica override, external_scaler_enabled); authOptions.secretName and the `auth_token` key;
the operator's calls (dashboard through the head Service's `dashboard` port, the head proxy's
/-/healthz on the `serve` port) and the submitter's labels; the worker readiness probe (a local
wget of :8000/-/healthz); ports 6379/8000/8265/8080/9464/10001; GPU and CPU counts; every config in
configs/ loads (profiles load as cost models).
"""
from __future__ import annotations

import re
import secrets
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from rollout_cluster.config import load_config

ROOT = Path(__file__).absolute().parents[1]
K8S = ROOT / "k8s"
README = K8S / "README.md"


def _service() -> dict:
    docs = [d for d in yaml.safe_load_all((K8S / "rayservice-a100x32.yaml").read_text()) if d]
    (svc,) = [d for d in docs if d.get("kind") == "RayService"]
    return svc


def _service_config():
    (app,) = yaml.safe_load(_service()["spec"]["serveConfigV2"])["applications"]
    return load_config(app["args"])


# ---- 2. the "work stuck" alert in k8s/README.md can never fire -----------------------------------
# A tiny evaluator of the PromQL forms the alert table uses, with Prometheus' documented semantics:
# a selector returns the stored series with all their labels (a PodMonitor adds namespace, pod,
# instance, job, container, endpoint); `sum(v)` without `by` returns ONE series with NO labels, or
# nothing when v is empty; `v > s` / `v == s` keep the elements that pass; `a and b` keeps the
# elements of a for which b has an element with exactly the same label set (the metric name aside),
# or the same values of the labels listed in `on(...)`, or of all labels but those in `ignoring(...)`.
_SCRAPE = {"namespace": "ml", "pod": "rollout-raycluster-x-head-abcde", "instance": "10.8.0.5:9464",
           "job": "ml/rollout-router", "container": "ray-head", "endpoint": "rollout-metrics"}


def _operand(text: str, db: dict) -> list:
    text = text.strip()
    m = re.fullmatch(r"\(\s*sum\s*\(\s*([a-z_:]+)\s*\)\s+or\s+vector\(([0-9.]+)\)\s*\)\s*(==|>|<|>=|<=|!=)\s*([0-9.]+)", text)
    if m:  # `or vector(n)`: the sum, or one label-less n when there are no series to sum
        series = db.get(m.group(1), [])
        vec = [({}, sum(v for _, v in series))] if series else [({}, float(m.group(2)))]
        return _compare(vec, m.group(3), float(m.group(4)))
    m = re.fullmatch(r"\(?\s*sum\s*(?:by\s*\(([^)]*)\)\s*)?\(\s*([a-z_:]+)\s*\)\s*\)?\s*(==|>|<|>=|<=|!=)\s*([0-9.]+)",
                     text)
    if m:
        by = [x.strip() for x in (m.group(1) or "").split(",") if x.strip()]
        series = db.get(m.group(2), [])
        groups: dict = {}
        for labels, value in series:
            key = tuple(sorted((k, labels.get(k, "")) for k in by))
            groups[key] = groups.get(key, 0.0) + value
        vec = [(dict(k), v) for k, v in groups.items()]
        op, bound = m.group(3), float(m.group(4))
    else:
        m = re.fullmatch(r"([a-z_:]+)\s*(==|>|<|>=|<=|!=)\s*([0-9.]+)", text)
        assert m, f"the review's evaluator cannot read {text!r}"
        vec, op, bound = list(db.get(m.group(1), [])), m.group(2), float(m.group(3))
    return _compare(vec, op, bound)


def _compare(vec: list, op: str, bound: float) -> list:
    keep = {"==": bound.__eq__, ">": bound.__lt__, "<": bound.__gt__, ">=": bound.__le__, "<=": bound.__ge__,
            "!=": bound.__ne__}[op]
    return [(labels, v) for labels, v in vec if keep(v)]


def _promql_and(expr: str, db: dict) -> list:
    m = re.fullmatch(r"(.+?)\s+and\s+(?:(on|ignoring)\s*\(([^)]*)\)\s*)?(.+)", expr.strip())
    assert m, f"the review's evaluator cannot read {expr!r}"
    left, right = _operand(m.group(1), db), _operand(m.group(4), db)
    names = [x.strip() for x in (m.group(3) or "").split(",") if x.strip()]

    def key(labels: dict):
        if m.group(2) == "on":
            return tuple(sorted((k, labels.get(k, "")) for k in names))
        return tuple(sorted((k, v) for k, v in labels.items() if k not in names))

    right_keys = {key(labels) for labels, _ in right}
    return [(labels, v) for labels, v in left if key(labels) in right_keys]


def _readme_alert(name: str) -> str:
    for line in README.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0] == name:
            m = re.match(r"`([^`]+)`", cells[1])
            assert m, line
            return m.group(1)
    raise AssertionError(f"k8s/README.md has no alert row {name!r}")


def test_work_stuck_alert_fires_when_work_is_queued_and_nothing_runs():
    """The "work stuck" alert fires while work is queued and nothing runs, with replicas alive and
    with none (the router then removes every rollout_sequences_running series, serve/metrics.py),
    and stays silent while anything runs or nothing is queued. (An earlier form,
    `rollout_sequences_queued > 0 and sum(rollout_sequences_running) == 0`, never fired: `and`
    matches whole label sets, and sum() has none.)"""
    expr = _readme_alert("work stuck")
    queued = {"rollout_sequences_queued": [(dict(_SCRAPE), 5.0)]}
    running = lambda *n: [(dict(_SCRAPE, replica=f"r{i}"), float(x)) for i, x in enumerate(n)]  # noqa: E731
    idle_fleet = dict(queued, rollout_sequences_running=running(0, 0, 0))  # no replica holds the current weights
    fired = {"replicas alive, none running": bool(_promql_and(expr, idle_fleet)),
             "no replica alive": bool(_promql_and(expr, queued))}
    assert all(fired.values()), f"k8s/README.md alert `{expr}` stays silent while work is stuck: {fired}"
    assert not _promql_and(expr, dict(queued, rollout_sequences_running=running(0, 4, 0)))  # one replica runs
    assert not _promql_and(expr, {"rollout_sequences_queued": [(dict(_SCRAPE), 0.0)],
                                  "rollout_sequences_running": running(0, 0)})  # nothing to run
    old = "rollout_sequences_queued > 0 and sum(rollout_sequences_running) == 0"
    assert not _promql_and(old, idle_fleet)  # (the evaluator tells the label sets apart)


# ---- the driver examples' control orders are signed ------------------------------------------
_SIGNED_CALLS = {"scale": "set_fleet_target", "cancel": "cancel", "update_weights": "update_weights",
                 "sleep": "sleep", "wake": "wake", "set_policy": "set_policy"}  # client call -> the Router's method
_ARGS = {"set_fleet_target": (24,), "cancel": ("batch-1",), "update_weights": ("/checkpoints/step-1",),
         "sleep": (1,), "wake": (), "set_policy": ({"name": "pull"},)}


class _Recorder:
    """A stand-in for the Router's Serve handle: records what each method was sent."""

    def __init__(self):
        self.sent = []

    def __getattr__(self, name):
        recorder = self

        class _Method:
            def remote(self, *args, **kwargs):
                recorder.sent.append((name, args, kwargs))

            def options(self, **_):
                return self

        return _Method()


def test_readme_driver_examples_sign_their_control_orders(monkeypatch, tmp_path):
    """Every `RolloutClient.connect(...).<control call>(` in k8s/README.md goes out signed with the
    keys the pods mount, and the cluster's Router (keys from the same Secret) takes it; the same call
    without control_keys_file goes out unsigned and is refused (the pods have no
    $ROLLOUT_CONTROL_KEYS, on purpose: tests/test_k8s.py forbids it)."""
    from ray import serve

    from rollout_cluster.client import lifecycle
    from rollout_cluster.security.secrets import read_keys
    from rollout_cluster.security.signing import OrderRefused, OrderVerifier

    text = README.read_text()
    calls = [(text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2))
             for m in re.finditer(r"RolloutClient\.connect\(([^()]*)\)\.(\w+)\(", text) if m.group(2) in _SIGNED_CALLS]
    assert len(calls) >= 2, "k8s/README.md's driver examples (scale, cancel) are gone"

    keys_file = tmp_path / "control-keys"  # the mounted Secret, as serveConfigV2's security names it
    keys_file.write_text(f"k1 {secrets.token_hex(32)}\n")
    sec = _service_config().security
    assert sec.control_keys_file == "/etc/rollout-secrets/control-keys"
    verifier = OrderVerifier(read_keys(sec.model_copy(update={"control_keys_file": str(keys_file)})))
    monkeypatch.delenv("ROLLOUT_CONTROL_KEYS", raising=False)  # a driver on a Ray pod (conftest sets one)
    monkeypatch.delenv("ROLLOUT_CONTROL_KEYS_FILE", raising=False)
    handle = _Recorder()
    monkeypatch.setattr(serve, "get_deployment_handle", lambda name, app: handle)

    def refusal(keys_file_arg):
        router = lifecycle.signed_router("rollout", None, keys_file_arg)  # what RolloutClient.connect holds
        getattr(router, op).remote(*_ARGS[op])
        (name, (order,), _) = handle.sent[-1]
        try:
            verifier.check(order, name, time.time())
        except OrderRefused as e:
            return str(e)

    refused = []
    for line, args, method in calls:
        op = _SIGNED_CALLS[method]
        m = re.search(r"control_keys_file=\"([^\"]+)\"", args)
        if m is None or m.group(1) != sec.control_keys_file:
            refused.append(f"k8s/README.md:{line}: connect({args}) names no control_keys_file={sec.control_keys_file!r}")
            continue
        why = refusal(str(keys_file))  # (the pod's path, here the test's copy of the Secret)
        if why:
            refused.append(f"k8s/README.md:{line} `{method}`: {why}")
        assert "unsigned" in (refusal(None) or ""), "an unsigned order would be taken"
    assert not refused, "\n".join(refused)
