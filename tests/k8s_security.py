"""What tests/test_k8s.py needs to check the manifests' secrets and network policy: a strict
schema for the NetworkPolicy fields we use, an evaluator of NetworkPolicy semantics (who may reach
which port), and a scanner for secret-looking strings."""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from typing import Iterator, Optional

import yaml

# ---- schema: networking.k8s.io/v1 NetworkPolicy, the fields we use, strictly ---------------------
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_SELECTOR = {"type": "object", "additionalProperties": False, "properties": {
    "matchLabels": _LABELS,
    "matchExpressions": {"type": "array", "items": {
        "type": "object", "required": ["key", "operator"], "additionalProperties": False, "properties": {
            "key": {"type": "string"}, "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
            "values": {"type": "array", "items": {"type": "string"}}}}}}}
_PEER = {"type": "object", "additionalProperties": False, "minProperties": 1, "properties": {
    "podSelector": _SELECTOR, "namespaceSelector": _SELECTOR,
    "ipBlock": {"type": "object", "required": ["cidr"], "additionalProperties": False, "properties": {
        "cidr": {"type": "string"}, "except": {"type": "array", "items": {"type": "string"}}}}}}
_PORTS = {"type": "array", "items": {"type": "object", "additionalProperties": False, "properties": {
    "protocol": {"enum": ["TCP", "UDP", "SCTP"]},
    "port": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 65535}, {"type": "string"}]},
    "endPort": {"type": "integer", "minimum": 1, "maximum": 65535}}}}
NETWORK_POLICY_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "networking.k8s.io/v1"}, "kind": {"const": "NetworkPolicy"},
        "metadata": {"type": "object", "required": ["name"], "additionalProperties": False,
                     "properties": {"name": {"type": "string"}, "namespace": {"type": "string"}, "labels": _LABELS}},
        "spec": {"type": "object", "required": ["podSelector"], "additionalProperties": False, "properties": {
            "podSelector": _SELECTOR,
            "policyTypes": {"type": "array", "items": {"enum": ["Ingress", "Egress"]}},
            "ingress": {"type": "array", "items": {"type": "object", "additionalProperties": False, "properties": {
                "from": {"type": "array", "items": _PEER}, "ports": _PORTS}}},
            "egress": {"type": "array", "items": {"type": "object", "additionalProperties": False, "properties": {
                "to": {"type": "array", "items": _PEER}, "ports": _PORTS}}}}},
    },
}


# ---- NetworkPolicy semantics ---------------------------------------------------------------------
@dataclass(frozen=True)
class Endpoint:
    """A peer: a pod (labels, its namespace's labels, whether it is in the policy's namespace, its
    IP), or an address outside the cluster (labels None)."""
    name: str  # for messages
    labels: Optional[dict] = None  # None: not a pod
    ns_labels: dict = field(default_factory=dict)
    same_ns: bool = True
    ip: str = "10.8.0.5"  # pods have private addresses


def selects(selector: Optional[dict], labels: dict) -> bool:
    """A label selector against labels; `{}` selects everything."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        has, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": has and value in e.get("values", []), "NotIn": not has or value not in e.get("values", []),
              "Exists": has, "DoesNotExist": not has}[e["operator"]]
        if not ok:
            return False
    return True


def peer_matches(peer: dict, ep: Endpoint) -> bool:
    if "ipBlock" in peer:
        ip = ipaddress.ip_address(ep.ip)
        block = peer["ipBlock"]
        return (ip in ipaddress.ip_network(block["cidr"])
                and not any(ip in ipaddress.ip_network(x) for x in block.get("except", [])))
    if ep.labels is None:  # selectors select pods only
        return False
    ns_ok = selects(peer["namespaceSelector"], ep.ns_labels) if "namespaceSelector" in peer else ep.same_ns
    return ns_ok and selects(peer.get("podSelector"), ep.labels)


def port_matches(ports: Optional[list], port: int, protocol: str) -> bool:
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != protocol or not isinstance(p.get("port", 0), int):
            continue  # a named port is not resolved here: the tests ask for numbers
        lo = p.get("port")
        if lo is None or lo == port or (p.get("endPort") and lo <= port <= p["endPort"]):
            return True
    return False


def allows(policy: dict, direction: str, ep: Endpoint, port: int, protocol: str = "TCP") -> bool:
    """Whether `policy` lets traffic of `direction` ("ingress": from ep; "egress": to ep) to a
    pod it selects through, on port/protocol. A policy that does not isolate `direction` allows it."""
    spec = policy["spec"]
    kind = direction.capitalize()
    types = spec.get("policyTypes") or (["Ingress", "Egress"] if "egress" in spec else ["Ingress"])
    if kind not in types:
        return True
    peers_key = "from" if direction == "ingress" else "to"
    return any((not rule.get(peers_key) or any(peer_matches(p, ep) for p in rule[peers_key]))
               and port_matches(rule.get("ports"), port, protocol)
               for rule in spec.get(direction, []))


# ---- secrets -------------------------------------------------------------------------------------
HEX = re.compile(r"[0-9a-fA-F]{16,}")
WORDISH = re.compile(r"[A-Za-z0-9_\-+/=]{16,}")
SECRET_ENV = re.compile(r"TOKEN|SECRET|PASSW|KEYS?$|CREDENTIAL", re.I)


def strings(node) -> Iterator[str]:
    """Every string in a YAML tree, keys too; a multi-line string (serveConfigV2, runtimeEnvYAML)
    is also parsed and walked."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield str(k)
            yield from strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from strings(v)
    elif isinstance(node, str):
        yield node
        if "\n" in node:
            try:
                inner = yaml.safe_load(node)
            except yaml.YAMLError:
                return
            if isinstance(inner, (dict, list)):
                yield from strings(inner)


def secret_looking(text: str) -> list:
    """Runs in `text` that look like a token or key: 16+ hex digits mixing digits and letters, or
    16+ base64/URL-safe characters mixing lower case, upper case and at least two digits (what
    `openssl rand -hex`, secrets.token_hex and secrets.token_urlsafe make)."""
    found = [m for m in HEX.findall(text) if re.search(r"\d", m) and re.search(r"[a-fA-F]", m)]
    for m in WORDISH.findall(text):
        if re.search(r"[a-z]", m) and re.search(r"[A-Z]", m) and len(re.findall(r"\d", m)) >= 2:
            found.append(m)
    return found


def containers(pod_spec: dict) -> list:
    return pod_spec.get("containers", []) + pod_spec.get("initContainers", [])


def env_errors(where: str, container: dict, secret_vars: set) -> list:
    """A container's env: none of our secret variables in any form (they are files), and no
    secret-named variable with a literal value."""
    errs = []
    for e in container.get("env", []):
        if e["name"] in secret_vars:
            errs.append(f"{where}: env {e['name']}: our secrets are mounted files, never environment variables")
        elif "value" in e and SECRET_ENV.search(e["name"]) and not e["name"].endswith(("_FILE", "_PATH")):
            errs.append(f"{where}: env {e['name']} holds a literal value: use a mounted Secret file")
    return errs
