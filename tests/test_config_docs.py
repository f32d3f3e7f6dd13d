"""docs/configuration.md is generated from rollout_cluster/config.py, and this test keeps them equal.

The key table comes from `dataclasses.fields` (path, type, default), the inline comment on each
field (meaning), and the `checks` list in `ClusterConfig.validate` (valid values). The error
examples come from running `load_config` on bad input. Regenerate after changing config.py:

    .venv/bin/python tests/test_config_docs.py
"""
from __future__ import annotations

import ast
import copy
import dataclasses
import io
import json
import re
import sys
import tokenize
import typing
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
REGEN = ".venv/bin/python tests/test_config_docs.py"

if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
from rollout_cluster import config as C  # noqa: E402

SRC = Path(C.__file__).read_text()
TREE = ast.parse(SRC)

# Meanings of fields that have no inline comment in config.py. An inline comment there wins:
# test_extra_meanings_are_needed fails when one is added, so this dict only ever shrinks.
EXTRA_MEANINGS = {
    "app_name": "Serve application name; drivers connect with `RolloutClient.connect(app_name=...)`",
    "replicas": "number of EngineReplica deployments, one vLLM engine each",
    "engine.dtype": "vLLM dtype (auto, bfloat16, float16, float32)",
    "engine.max_model_len": "context limit per sequence (prompt + output)",
    "engine.max_num_batched_tokens": "vLLM scheduler: tokens per step; set always (AsyncLLM defaults to 2048)",
    "engine.tensor_parallel_size": "GPUs per replica's engine; > 1: one worker process per rank, on the replica's GPUs (one node)",
    "engine.gpu_memory_utilization": "fraction of GPU memory vLLM may take (weights + KV cache)",
    "engine.enable_prefix_caching": "vLLM prefix caching; makes a migrated sequence's re-prefill cheaper for its siblings",
    "engine.enforce_eager": "disable CUDA graphs (faster start, slower decode)",
    "engine.seed": "engine seed (per-request seeds come with the SamplingSpec)",
    "engine.sim_vocab_size": "kind=sim: token ids are drawn below this",
    "resources.num_cpus": "Ray CPUs per replica",
    "resources.num_gpus": "Ray GPUs per replica (0 on the CPU build)",
    "policy.max_moves_per_decision": "steal: cap on sequences moved by one decision",
    "sampling.max_tokens": "output cap per sequence; must stay below engine.max_model_len",
    "sampling.temperature": "sampling temperature (0: greedy)",
    "sampling.top_p": "nucleus sampling threshold",
}

# Bad inputs whose ConfigError messages the docs show; rendered by running load_config.
ERROR_EXAMPLES = [
    {"engine": {"max_num_seqs": "many"}},
    {"engine": {"enable_prefix_caching": "yes"}},
    {"engine": {"modle": "Qwen/Qwen2.5-7B-Instruct"}},
    {"engine": 3},
    {"replicas": 0},
    {"replicas": 32, "router": {"max_ongoing_requests": 32}},
    {"policy": {"name": "random"}},
    {"sampling": {"max_tokens": 8192}},
]


# ---- introspection ----------------------------------------------------------------------------
def fields(cls=C.ClusterConfig, prefix=""):
    """(path, field, type) for every leaf field; nested dataclasses become path prefixes."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from fields(tp, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name, f, tp


def sections(cls=C.ClusterConfig):
    """(prefix, dataclass) in declaration order; the top level has prefix ''."""
    out = [("", cls)]
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.append((f.name, hints[f.name]))
    return out


def _classes():
    return {n.name: n for n in TREE.body if isinstance(n, ast.ClassDef)}


def inline_comments() -> dict:
    """(class name, field name) -> the comment on the field's line in config.py."""
    by_line = {tok.start[0]: tok.string.lstrip("#").strip()
               for tok in tokenize.generate_tokens(io.StringIO(SRC).readline) if tok.type == tokenize.COMMENT}
    out = {}
    for name, node in _classes().items():
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.end_lineno in by_line:
                out[(name, stmt.target.id)] = by_line[stmt.end_lineno]
    return out


class _Inline(ast.NodeTransformer):
    """Spell module constants out (POLICY_NAMES -> the sorted names) so the docs show values."""

    def visit_Name(self, node):
        value = getattr(C, node.id, None)
        if node.id.isupper() and isinstance(value, (set, frozenset, list, tuple)):
            return ast.Constant(tuple(sorted(value)))
        return node


def _strip_self(code: str) -> str:
    return code.replace("self.", "")


def checks() -> dict:
    """path -> [condition as code] from the `checks` list in ClusterConfig.validate."""
    validate = next(n for n in _classes()["ClusterConfig"].body
                    if isinstance(n, ast.FunctionDef) and n.name == "validate")
    lst = next(n.value for n in ast.walk(validate)
               if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", None) == "checks")
    out: dict = {}
    for elt in lst.elts:
        key = elt.elts[0].value
        out.setdefault(key, []).append(_strip_self(ast.unparse(_Inline().visit(copy.deepcopy(elt.elts[1])))))
    return out


def meaning(path: str, cls, name: str, comments: dict) -> str:
    return comments.get((cls.__name__, name)) or EXTRA_MEANINGS.get(path, "")


def _owner(path: str):
    cls = C.ClusterConfig
    for part in path.split(".")[:-1]:
        cls = typing.get_type_hints(cls)[part]
    return cls


def default_of(f) -> object:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def yaml_value(v) -> str:
    """A default as YAML would spell it."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)
    return json.dumps(v) if isinstance(v, list) else repr(v)


def type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def row_prefix(path: str, f, tp) -> str:
    return f"| `{path}` | {type_name(tp)} | `{yaml_value(default_of(f))}` |"


# ---- rendering ----------------------------------------------------------------------------------
def render_reference() -> str:
    comments, valid = inline_comments(), checks()
    lines = []
    for prefix, cls in sections():
        title = f"`{prefix}`" if prefix else "top level"
        lines += [f"### {title}", ""]
        doc = cls.__doc__ if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "(") else None
        if doc:
            lines += [" ".join(doc.split()), ""]
        lines += ["| key | type | default | valid | meaning |", "|---|---|---|---|---|"]
        for path, f, tp in fields():
            if (path.rsplit(".", 1)[0] if "." in path else "") != prefix:
                continue
            ok = "; ".join(f"`{c}`" for c in valid.get(path, []))
            lines.append(f"{row_prefix(path, f, tp)} {_cell(ok)} | {_cell(meaning(path, cls, f.name, comments))} |")
        lines.append("")
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
FIELD_PATHS = [p for p, _, _ in fields()]


@pytest.fixture(scope="module")
def doc() -> str:
    assert DOC.exists(), f"{DOC} is missing; create it with the markers and run {REGEN}"
    return DOC.read_text()


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_generated_block_is_current(doc, name):
    assert block_in(doc, name) == BLOCKS[name](), f"docs/configuration.md is stale: run {REGEN}"


@pytest.mark.parametrize("path", FIELD_PATHS)
def test_every_field_has_a_row_with_its_default(doc, path):
    _, f, tp = next(x for x in fields() if x[0] == path)
    assert row_prefix(path, f, tp) in doc, f"no row for {path} with its current default: run {REGEN}"


@pytest.mark.parametrize("path", FIELD_PATHS)
def test_every_field_has_a_meaning(path):
    cls, name = _owner(path), path.rsplit(".", 1)[-1]
    assert meaning(path, cls, name, inline_comments()), \
        f"{path} has no inline comment in config.py and no EXTRA_MEANINGS entry"


def test_extra_meanings_are_needed():
    comments = inline_comments()
    stale = [p for p in EXTRA_MEANINGS if p not in FIELD_PATHS]
    shadowed = [p for p in EXTRA_MEANINGS if p in FIELD_PATHS and (_owner(p).__name__, p.rsplit(".", 1)[-1]) in comments]
    assert not stale, f"EXTRA_MEANINGS names fields that no longer exist: {stale}"
    assert not shadowed, f"config.py now comments these; drop them from EXTRA_MEANINGS: {shadowed}"


def test_every_check_names_a_field():
    assert set(checks()) <= set(FIELD_PATHS)
    assert len(checks()) >= 20  # the parse of validate() found the list, not an empty one


def test_comments_are_found():
    assert inline_comments()[("EngineConfig", "max_num_seqs")].startswith("set always")


def test_prose_names_only_real_keys(doc):
    """Every `section.key` the hand-written prose mentions must still exist."""
    prose = doc
    for name in BLOCKS:
        prose = prose.replace(block_in(doc, name), "")
    heads = {p for p, _ in sections() if p}
    named = {m for m in re.findall(r"`([a-z_]+\.[a-z_]+)`", prose) if m.split(".")[0] in heads}
    assert named, "the prose should name config keys"
    missing = sorted(named - set(FIELD_PATHS))
    assert not missing, f"docs/configuration.md names keys that do not exist: {missing}"


def test_error_examples_match_the_message_format(doc):
    assert "`engine.max_num_seqs='many': must be of type int`" in doc


if __name__ == "__main__":
    regenerate()
    print(f"rewrote {DOC.relative_to(ROOT)}")
