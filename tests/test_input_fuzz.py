"""Property tests (Hypothesis) of issue 24's input rules: generated JSONL lines go through
read_requests and a real RouterCore.submit, generated config files through load_config.

Properties: nothing but InputError / ConfigError escapes; every error names a field (`<field>=...`,
`line N=...`, or for a config `<key path>=...`, `<key path>: ...`, `config file '...'`); a valid line
yields its n requests and, run, its n samples; a line mutated to be invalid (a boolean, NaN or an
infinity, an integer past 64 bits, nesting, a duplicate or unknown key, bad resumed output) is
refused naming the field it broke; merge_results gives each line its samples or one error line.
COUNTS sums what was generated; run with -s to see it printed.
"""
import json
import re
from collections import Counter

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout_cluster.client.jsonl import LINE_FIELDS, merge_results, read_requests
from rollout_cluster.config import ConfigError, PolicyConfig, load_config
from rollout_cluster.config.models import ClusterConfig, Section
from rollout_cluster.engines.cost_model import load_profile
from rollout_cluster.policy import make_policy
from rollout_cluster.policy.registry import REGISTRY
from rollout_cluster.protocol import EngineStats, ModelInfo, Report, SeqProgress
from rollout_cluster.router.core import RouterCore

COUNTS = Counter()
COST = load_profile("h200-1.5b", max_num_seqs=64)
MODEL = ModelInfo(1000, 64, max_logprobs=5, max_temperature=2.0)
FAST = dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
NAMED = re.compile(r"^(line \d+|[a-z_]+)=")

# ---- JSONL lines ---------------------------------------------------------------------------------
INTS = ("n", "max_tokens", "min_tokens", "top_k", "logprobs", "seed")
FLOATS = ("temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


@st.composite
def valid_line(draw) -> dict:
    """A line the reader and a router serving MODEL accept (the prompt + max_tokens fit 64)."""
    line = {"prompt_token_ids": draw(st.lists(st.integers(0, 999), min_size=1, max_size=8))}
    opt = {
        "n": st.integers(1, 3), "max_tokens": st.integers(1, 32), "temperature": st.floats(0, 2),
        "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1), "ignore_eos": st.booleans(),
        "logprobs": st.one_of(st.none(), st.integers(0, 5)), "seed": st.one_of(st.none(), st.integers(-2**63, 2**63 - 1)),
        "stop_token_ids": st.lists(st.integers(0, 999), max_size=3), "repetition_penalty": st.floats(0.01, 5),
        "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
        "cache_salt": st.one_of(st.none(), st.text(min_size=1, max_size=8)),
    }
    for k in draw(st.sets(st.sampled_from(sorted(opt)))):
        line[k] = draw(opt[k])
    if draw(st.booleans()):  # a resumed partial rollout: one sample, output-counting penalties off
        made = draw(st.integers(1, line.get("max_tokens", 32) - 1)) if line.get("max_tokens", 32) > 1 else 0
        if made:
            line.update(n=1, presence_penalty=0.0, frequency_penalty=0.0, min_tokens=0,
                        output_token_ids=draw(st.lists(st.integers(0, 999), min_size=made, max_size=made)))
            if line.get("logprobs") is not None:
                line["output_logprobs"] = draw(st.lists(st.floats(-50, 0), min_size=made, max_size=made))
    if "min_tokens" not in line and draw(st.booleans()):
        line["min_tokens"] = draw(st.integers(0, line.get("max_tokens", 1)))
    return line


def text_of(pairs: list) -> str:
    """A JSON object's text from (key, raw value text) pairs: raw, so that a key may come twice."""
    return "{" + ", ".join(f"{json.dumps(k)}: {v}" for k, v in pairs) + "}"


def raw(value) -> str:
    return json.dumps(value, allow_nan=True)


def huge(draw, digits_from: int) -> str:
    return draw(st.sampled_from(["", "-"])) + "9" * draw(st.integers(digits_from, 6000))


@st.composite
def bad_value(draw, field: str) -> str:
    """Raw text of a value that `field` must refuse, whatever else the line says."""
    kind = draw(st.sampled_from(["bool", "nonfinite", "huge", "string", "nested", "object"]))
    if field == "ignore_eos":
        kind = draw(st.sampled_from(["nonfinite", "huge", "string", "nested", "object", "number"]))
        if kind == "number":
            return raw(draw(st.integers(-5, 5)))
    if field == "cache_salt" and kind in ("string", "bool"):
        return draw(st.sampled_from(['""', "true", "false", "0"]))
    if kind == "bool":
        return draw(st.sampled_from(["true", "false"]))
    if kind == "nonfinite":
        return draw(st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e999"]))
    if kind == "huge":  # past 64 bits; for a float field past a double
        return huge(draw, 310 if field in FLOATS else 20)
    if kind == "string":
        return raw(draw(st.text(max_size=10)))
    if kind == "nested":
        depth = draw(st.integers(2, 3000))
        return "[" * depth + "]" * depth
    return raw({"x": 1})


@st.composite
def mutated_line(draw) -> tuple:
    """(text, names): a valid line broken in one way; `names` are the fields its error may name."""
    line = draw(valid_line())
    pairs = [(k, raw(v)) for k, v in line.items()]
    how = draw(st.sampled_from(["field", "field", "duplicate", "unknown", "resumed", "token"]))
    if how == "field":
        field = draw(st.sampled_from(MUTABLE))  # (each field in turn: the test below)
        value = "null" if field == "prompt_token_ids" and draw(st.booleans()) else draw(bad_value(field))
        if field == "stop_token_ids" and not value.startswith("[") and draw(st.booleans()):
            value = f"[{value}]"  # the bad value as an element (nested lists hold no integer either)
        pairs = [(k, v) for k, v in pairs if k != field] + [(field, value)]
        return text_of(pairs), {field}
    if how == "duplicate":
        k, v = draw(st.sampled_from(pairs))
        return text_of(pairs + [(k, v)]), {k}
    if how == "unknown":
        name = draw(st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12).filter(lambda s: s not in LINE_FIELDS))
        return text_of(pairs + [(name, draw(st.sampled_from(["1", "null", "NaN", '"x"', "[]"])))]), {name}
    if how == "token":  # a prompt token that no engine has
        bad = draw(st.sampled_from(["null", "-1", "true", "1.5", '"7"', str(2**31), huge(draw, 20)]))
        ids = line["prompt_token_ids"]
        at = draw(st.integers(0, len(ids)))
        text_ids = "[" + ", ".join([raw(t) for t in ids[:at]] + [bad] + [raw(t) for t in ids[at:]]) + "]"
        return text_of([(k, v) for k, v in pairs if k != "prompt_token_ids"] + [("prompt_token_ids", text_ids)]), \
            {"prompt_token_ids"}
    # resumed output that cannot continue
    out = line.get("output_token_ids") or [1]
    spec = {k: v for k, v in line.items() if k not in ("output_token_ids", "output_logprobs")}
    spec.update(n=1, max_tokens=max(spec.get("max_tokens", 32), len(out) + 1), logprobs=0,
                presence_penalty=0.0, frequency_penalty=0.0, min_tokens=0)
    bad_lps = draw(st.sampled_from(["null", "NaN", "Infinity", "-Infinity", "0.5", '"x"', "true", huge(draw, 310)]))
    at = draw(st.integers(0, len(out) - 1))
    lps = ["-1.0"] * len(out)
    lps[at] = bad_lps
    if draw(st.booleans()):
        lps = lps[:-1] if len(lps) > 1 else lps + ["-1.0"]  # one logprob too few or too many
        bad_lps = None
    pairs = [(k, raw(v)) for k, v in spec.items()] + [("output_token_ids", raw(out)),
                                                       ("output_logprobs", "[" + ", ".join(lps) + "]")]
    return text_of(pairs), {"output_logprobs"}


@st.composite
def beyond_the_engine(draw) -> tuple:
    """(text, field): a line the reader accepts and a router serving MODEL refuses, naming `field`."""
    line = {k: v for k, v in draw(valid_line()).items() if k not in ("output_token_ids", "output_logprobs")}
    field = draw(st.sampled_from(["prompt_token_ids", "stop_token_ids", "logprobs", "temperature", "max_tokens"]))
    if field in ("prompt_token_ids", "stop_token_ids"):  # an id past the vocabulary (1000)
        line[field] = line.get(field, []) + [draw(st.integers(1000, 2**31 - 1))]
    elif field == "logprobs":
        line[field] = draw(st.integers(6, 10**6))
    elif field == "temperature":
        line[field] = draw(st.floats(2, 1e300, exclude_min=True))
    else:
        line[field] = draw(st.integers(65 - len(line["prompt_token_ids"]), 2**63 - 1))
        line["min_tokens"] = 0
    return json.dumps(line), field


DEFAULTS = {"max_tokens": 32}  # the config's sampling section: what a line leaves out
garbage = st.one_of(st.text(max_size=40), st.binary(max_size=40).map(lambda b: b.decode("utf-8", "replace")),
                    st.sampled_from(["{", "[1]", "null", '"x"', "{}", "{'a': 1}", "{\"prompt_token_ids\": [1]"]))
line_kinds = st.one_of(valid_line().map(lambda d: ("valid", json.dumps(d), set())),
                       mutated_line().map(lambda m: ("bad", m[0], m[1])),
                       beyond_the_engine().map(lambda m: ("engine", m[0], {m[1]})),
                       garbage.map(lambda t: ("garbage", t, set())))


def drive(core: RouterCore, bid: str, now: float) -> list:
    """Run every queued sequence on replica a to its end; the batch's completions in order."""
    for _ in range(100):
        work = core.decide("a", now).start
        finals = [SeqProgress(w.seq_id, w.attempt, [5] * w.sampling.max_tokens,
                              None if w.sampling.logprobs is None else [-0.5] * w.sampling.max_tokens,
                              "length", offset=0) for w in work]
        now += 0.1
        core.on_report(Report("a", "a-1", progress=finals, stats=EngineStats(), capacity=64), now)
        got, _, done = core.fetch(bid, 0)
        if done:
            return sorted(got, key=lambda c: c.index)
    raise AssertionError("the batch did not finish")


@settings(max_examples=600, **FAST)
@given(st.lists(line_kinds, min_size=1, max_size=8))
def test_generated_lines_never_escape_and_every_error_names_a_field(kinds):
    lines = [text for _, text, _ in kinds]
    COUNTS["jsonl lines"] += len(lines)
    requests, errors = read_requests(lines, DEFAULTS)  # nothing may escape
    for i, (kind, text, names) in enumerate(kinds):
        mine = [r for r in requests if r.prompt_index == i]
        if kind in ("valid", "engine"):
            assert i not in errors and len(mine) == json.loads(text).get("n", 1), (text, errors.get(i))
        if kind == "bad":
            assert i in errors, f"accepted: {text[:200]}"
            name = NAMED.match(errors[i])
            assert name and (name.group(1) in names or name.group(1).startswith("line ")), (errors[i], names)
        if i in errors:
            assert not mine and NAMED.match(errors[i]), errors[i]
            COUNTS["jsonl errors naming a field"] += 1
    core = RouterCore(make_policy(PolicyConfig(name="pull"), COST), 1, 1e9)
    core.on_report(Report("a", "a-1", model=MODEL, capacity=64), 0.0)
    completions = drive(core, core.submit(requests, 1.0), 1.0) if requests else []  # nothing may escape
    assert not core.seqs
    records = merge_results(len(lines), requests, completions, errors)
    assert len(records) == sum(1 if i in errors else len([r for r in requests if r.prompt_index == i])
                               for i in range(len(lines)))
    for rec in records:
        kind, _, names = kinds[rec["prompt_index"]]
        if kind == "valid":
            assert rec["finish_reason"] == "length" and rec["error"] is None, rec["error"]
        if kind == "engine":
            assert rec["finish_reason"] == "error" and NAMED.match(rec["error"]).group(1) in names, rec["error"]
        if rec["finish_reason"] == "error":
            assert NAMED.match(rec["error"]), rec["error"]
    COUNTS["sequences submitted"] += len(requests)
    COUNTS["router errors naming a field"] += sum(1 for c in completions if c.finish_reason == "error")


MUTABLE = sorted(set(INTS + FLOATS) | {"ignore_eos", "stop_token_ids", "cache_salt", "prompt_token_ids"})


@pytest.mark.parametrize("field", MUTABLE)
@settings(max_examples=60, **FAST)
@given(data=st.data())
def test_each_field_given_a_value_it_must_refuse_is_refused_naming_it(field, data):
    line = data.draw(valid_line())
    value = "null" if field == "prompt_token_ids" and data.draw(st.booleans()) else data.draw(bad_value(field))
    if field == "stop_token_ids" and not value.startswith("[") and data.draw(st.booleans()):
        value = f"[{value}]"
    text = text_of([(k, raw(v)) for k, v in line.items() if k != field] + [(field, value)])
    COUNTS["jsonl lines"] += 1
    requests, errors = read_requests([text], DEFAULTS)
    assert not requests and NAMED.match(errors[0]).group(1) in (field, "line 1"), (errors, text[:200])
    COUNTS["jsonl errors naming a field"] += 1


# ---- config files --------------------------------------------------------------------------------
def leaves() -> list:
    """(key path, FieldInfo) of every key a config may set, policy settings of each policy included."""
    out = []
    for name, info in ClusterConfig.model_fields.items():
        tp = info.annotation
        if isinstance(tp, type) and issubclass(tp, Section):
            out += [((name, k), f) for k, f in tp.model_fields.items()]
        elif name != "policy":
            out.append(((name,), info))
    for entry in REGISTRY.values():
        out += [(("policy", k), f) for k, f in entry.settings.model_fields.items() if k != "name"]
    return out


LEAVES = leaves()
RAW = "__raw_{}__"  # a placeholder replaced by raw YAML text once the mapping is dumped


@st.composite
def config_text(draw) -> tuple:
    """(YAML text, must_fail): a config with a few keys set to generated values, and sometimes raw
    text that no config may hold (a key twice, an alias bomb, deep nesting, garbage)."""
    data, raws, refused = {}, [], {}
    for path, info in draw(st.lists(st.sampled_from(LEAVES), max_size=4)):
        value = draw(st.one_of(
            st.integers(-10, 10**6), st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(),
            st.text(max_size=8), st.lists(st.integers(-3, 3), max_size=3), st.dictionaries(st.text(max_size=3),
                                                                                           st.integers(), max_size=2),
            st.sampled_from([float("inf"), float("nan"), 2**63, -2**63 - 1, 2**70, "", "RAWHUGE"])))
        if value == "RAWHUGE":
            raws.append("9" * draw(st.integers(20, 6000)))
            value = RAW.format(len(raws) - 1)
        refused[path] = (  # a float field given NaN or an infinity, an int past 64 bits, no model
            info.annotation is float and isinstance(value, float) and not abs(value) < float("inf")
            or info.annotation is int and isinstance(value, int) and not -2**63 <= value < 2**63
            or path == ("engine", "model") and value == "")
        if path[0] == "policy":
            data.setdefault("policy", {"name": next(n for n, e in REGISTRY.items() if path[1] in e.settings.model_fields)})
        node = data
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    must_fail = any(refused.values())  # (a path drawn twice: its last value)
    text = yaml.safe_dump(data, sort_keys=False) if data else ""
    for i, r in enumerate(raws):
        text = text.replace(RAW.format(i), r)
    extra = draw(st.sampled_from(["", "", "", "duplicate", "bomb", "nested", "garbage", "unknown"]))
    COUNTS[f"config extra {extra or 'none'}"] += 1
    if extra == "duplicate" and data:
        key = next(iter(data))
        text += f"{key}: {draw(st.sampled_from(['1', '{}', 'x']))}\n"
        must_fail = True
    elif extra == "bomb":
        text += "x0: &x0 [a, a, a, a, a, a, a, a, a, a]\n" + "".join(
            f"x{i}: &x{i} [{', '.join([f'*x{i - 1}'] * 10)}]\n" for i in range(1, draw(st.integers(4, 7))))
        must_fail = True
    elif extra == "nested":
        depth = draw(st.integers(2, 700))  # PyYAML gives up past about 500 (and takes ~1 s at 3000)
        text += "deep: " + "[" * depth + "]" * depth + "\n"
        must_fail = True
    elif extra == "garbage":
        text, must_fail = draw(st.text(max_size=60)), False  # (it replaces the mapping)
    elif extra == "unknown":
        key = draw(st.sampled_from(["replica", "engin", "zzz", '"\\\\"', '"a.b"', "é: x"]))
        text += f"{key}: 1\n"
        must_fail = True
    return text, must_fail


QUOTED = r'"(?:\\.|[^"\\])*"(?:\.\.\.)?'  # a key that is no plain name, JSON-quoted
PATH = re.compile(r"^(config file '|config must be a mapping|"
                  rf"(?:[A-Za-z_][\w-]*|\[\d+\]|{QUOTED})(?:\.(?:[^.=:\s\"]+|{QUOTED})|\[\d+\])*(?:=|: ))")


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz-configs")


@settings(max_examples=800, **FAST)
@given(config_text())
def test_generated_configs_raise_only_config_errors_naming_a_key_path(config_dir, case):
    text, must_fail = case
    COUNTS["configs"] += 1
    path = config_dir / "c.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    try:
        load_config(path)
    except ConfigError as e:
        for part in str(e).split("; "):
            assert PATH.match(part), part[:200]
        COUNTS["config errors naming a key path"] += 1
        return
    assert not must_fail, text[:300]


def test_zz_print_the_counts():
    print("\nfuzz counts:", dict(sorted(COUNTS.items())))
