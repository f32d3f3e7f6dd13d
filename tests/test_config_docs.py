"""docs/configuration.md is generated from the config models, and this test keeps them equal.

The key table comes from the pydantic models (rollout_cluster/config/models.py and each policy's
settings model beside the policy): path, type and default from the field, the valid values from
its constraints and its `also` rule (the one a model validator enforces), the meaning from its
`description`. The error examples come from running `load_config` on bad input. Regenerate after
changing a model:

    .venv/bin/python tests/test_config_docs.py
"""
from __future__ import annotations

import json
import re
import sys
import typing
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
REGEN = ".venv/bin/python tests/test_config_docs.py"

if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
from rollout_cluster import config as C  # noqa: E402
from rollout_cluster.config.errors import rule_of  # noqa: E402
from rollout_cluster.policy.registry import DEFAULT_POLICY, POLICY_NAMES, REGISTRY  # noqa: E402

# Bad inputs whose ConfigError messages the docs show; rendered by running load_config.
ERROR_EXAMPLES = [
    {"engine": {"max_num_seqs": "many"}},
    {"engine": {"enable_prefix_caching": "yes"}},
    {"engine": {"modle": "Qwen/Qwen2.5-7B-Instruct"}},
    {"engine": 3},
    {"replicas": 0},
    {"router": {"pull_wait_s": 0}},
    {"replicas": 32, "router": {"max_ongoing_requests": 32}},
    {"policy": {"name": "random"}},
    {"policy": {"name": "pull", "chunk_tokens": 512}},
    {"sampling": {"max_tokens": 8192}},
]


# ---- introspection ----------------------------------------------------------------------------
class Row(typing.NamedTuple):
    path: str
    info: object  # pydantic FieldInfo
    section: str  # the heading the row sits under


def _is_model(tp) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _policy_name_row() -> Row:
    """`policy.name` is the union's discriminator: one row for all policies."""
    info = C.models.Field(DEFAULT_POLICY, description=C.ClusterConfig.model_fields["policy"].description)
    info.annotation = Literal[tuple(POLICY_NAMES)]
    return Row("policy.name", info, "policy")


def sections() -> list:
    """(heading, model or None, key prefix) in declaration order; the policy's settings follow
    `policy`, one heading per policy that has any."""
    out = [("top level", C.ClusterConfig, "")]
    for name, f in C.ClusterConfig.model_fields.items():
        if _is_model(f.annotation):
            out.append((name, f.annotation, name + "."))
        elif name == "policy":
            out.append(("policy", None, "policy."))
            out += [(f"policy: {p}", e.settings, "policy.") for p, e in REGISTRY.items() if len(e.settings.model_fields) > 1]
    return out


def rows() -> list:
    out = []
    for heading, model, prefix in sections():
        if model is None:
            out.append(_policy_name_row())
            continue
        for name, info in model.model_fields.items():
            if not _is_model(info.annotation) and name != "policy" and not (prefix == "policy." and name == "name"):
                out.append(Row(prefix + name, info, heading))
    return out


def valid_of(info) -> list:
    also = (info.json_schema_extra or {}).get("also")
    return [r for r in (rule_of(info), also) if r]


def type_name(tp) -> str:
    if typing.get_origin(tp) is Literal:
        return type(typing.get_args(tp)[0]).__name__
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Union:
        return f"{type_name(args[0])} or null"
    if typing.get_origin(tp) is list:
        return f"list[{type_name(args[0])}]"
    return getattr(tp, "__name__", str(tp))


def yaml_value(v) -> str:
    """A default as YAML would spell it."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    return json.dumps(v) if isinstance(v, (str, list)) else repr(v)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def row_prefix(row: Row) -> str:
    default = row.info.get_default(call_default_factory=True)
    return f"| `{row.path}` | {type_name(row.info.annotation)} | `{yaml_value(default)}` |"


# ---- rendering ----------------------------------------------------------------------------------
def render_reference() -> str:
    lines = []
    for heading, model, _ in sections():
        lines += [f"### `{heading}`" if heading != "top level" else "### top level", ""]
        doc = model.__doc__ if model is not None else None
        if doc:
            lines += [" ".join(doc.split()), ""]
        lines += ["| key | type | default | valid | meaning |", "|---|---|---|---|---|"]
        for row in rows():
            if row.section == heading:
                ok = "; ".join(f"`{c}`" for c in valid_of(row.info))
                lines.append(f"{row_prefix(row)} {_cell(ok)} | {_cell(row.info.description or '')} |")
        lines.append("")
        if model is None:
            bare = [p for p, e in REGISTRY.items() if len(e.settings.model_fields) == 1]
            lines += [f"Policies with no settings beyond `name`: {', '.join(f'`{p}`' for p in bare)}.", ""]
    return "\n".join(lines).rstrip() + "\n"


def error_of(data: dict) -> str:
    try:
        C.load_config(data)
    except C.ConfigError as e:
        return str(e)
    raise AssertionError(f"{data!r} loads without error; it cannot be an error example")


def render_errors() -> str:
    lines = ["| YAML | ConfigError |", "|---|---|"]
    for data in ERROR_EXAMPLES:
        y = yaml.safe_dump(data, default_flow_style=True, sort_keys=False).strip()
        lines.append(f"| `{_cell(y)}` | `{_cell(error_of(data))}` |")
    return "\n".join(lines) + "\n"


BLOCKS = {"config-reference": render_reference, "config-errors": render_errors}


def _markers(name: str) -> tuple:
    return (f"<!-- BEGIN GENERATED {name}: {REGEN} -->\n", f"<!-- END GENERATED {name} -->")


def block_in(text: str, name: str) -> str:
    begin, end = _markers(name)
    assert begin in text and end in text, f"docs/configuration.md lacks the markers of block {name!r}"
    return text.split(begin, 1)[1].split(end, 1)[0]


def regenerate() -> None:
    text = DOC.read_text()
    for name, render in BLOCKS.items():
        begin, end = _markers(name)
        text = text.replace(begin + block_in(text, name) + end, begin + render() + end)
    DOC.write_text(text)


# ---- tests --------------------------------------------------------------------------------------
ROWS = {r.path: r for r in rows()}
FIELD_PATHS = list(ROWS)


@pytest.fixture(scope="module")
def doc() -> str:
    assert DOC.exists(), f"{DOC} is missing; create it with the markers and run {REGEN}"
    return DOC.read_text()


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_generated_block_is_current(doc, name):
    assert block_in(doc, name) == BLOCKS[name](), f"docs/configuration.md is stale: run {REGEN}"


@pytest.mark.parametrize("path", FIELD_PATHS)
def test_every_field_has_a_row_with_its_default(doc, path):
    assert row_prefix(ROWS[path]) in doc, f"no row for {path} with its current default: run {REGEN}"


@pytest.mark.parametrize("path", FIELD_PATHS)
def test_every_field_has_a_meaning(path):
    assert ROWS[path].info.description, f"{path} has no Field(description=...)"


def test_every_policy_setting_is_documented_once():
    """Every key of every policy's settings model has a row, and no two policies share a key
    (an error names the one policy a misplaced key belongs to)."""
    keys = [k for e in REGISTRY.values() for k in e.settings.model_fields if k != "name"]
    assert len(keys) == len(set(keys))
    assert {f"policy.{k}" for k in keys} | {"policy.name"} == {p for p in FIELD_PATHS if p.startswith("policy.")}


def test_rules_are_found():
    assert valid_of(ROWS["engine.max_num_seqs"].info) == [">= 1"]
    assert valid_of(ROWS["router.pull_wait_s"].info) == ["in (0, 5]", "<= min(5, router.replica_timeout_s / 4)"]
    assert valid_of(ROWS["engine.niceness"].info) == ["null or in [-20, 19]"]
    assert len([p for p in FIELD_PATHS if valid_of(ROWS[p].info)]) >= 30


def test_prose_names_only_real_keys(doc):
    """Every `section.key` the hand-written prose mentions must still exist."""
    prose = doc
    for name in BLOCKS:
        prose = prose.replace(block_in(doc, name), "")
    heads = {prefix.rstrip(".") for _, _, prefix in sections() if prefix}
    named = {m for m in re.findall(r"`([a-z_]+\.[a-z_]+)`", prose) if m.split(".")[0] in heads}
    assert named, "the prose should name config keys"
    missing = sorted(named - set(FIELD_PATHS))
    assert not missing, f"docs/configuration.md names keys that do not exist: {missing}"


def test_error_examples_match_the_message_format(doc):
    assert "`engine.max_num_seqs='many': must be of type int`" in doc
    assert "`policy.chunk_tokens: a setting of policy 'chunked', not of 'pull'`" in doc


if __name__ == "__main__":
    regenerate()
    print(f"rewrote {DOC.relative_to(ROOT)}")
