"""ConfigError, and pydantic's ValidationError reworded as `<key path>=<value>: <rule>`.

The rule of a field comes from its own constraints (`rule_of`, which the docs use too), or for a
rule between fields from the `also` text its model validator raises (FieldRuleError).
"""
from __future__ import annotations

import json
import re
import typing
from typing import Literal

import annotated_types as at
from pydantic import BaseModel, Discriminator, ValidationError

from ..parsing import LongInteger, shown
from ..policy.base import PolicySettings
from ..policy.registry import POLICY_NAMES, REGISTRY, owners_of
from ..strict_model import INT_RULE


class ConfigError(ValueError):
    pass


class FieldRuleError(ValueError):
    """A rule between fields failed: `key` (a path below the model that raised) holds `value`."""

    def __init__(self, key: str, value, rule: str):
        super().__init__(f"{key}={shown(value)}: must be {rule}")
        self.key, self.value, self.rule = key, value, rule


_TYPES = {"int_type": "must be of type int", "float_type": "must be of type float", "bool_type": "must be of type bool",
          "string_type": "must be of type str", "list_type": "must be a list", "model_type": "must be a mapping",
          "dict_type": "must be a mapping", "model_attributes_type": "must be a mapping",
          "finite_number": "must be a finite number", "string_too_short": "must not be empty",
          "int_too_long": INT_RULE, "recursion_loop": "must not contain itself"}
_BOUNDS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal", "literal_error", "string_too_short")


def rule_of(info) -> str:
    """A field's own rule as errors and docs state it: '>= 1', 'in (0, 5]', "one of ['sim', 'vllm']",
    'null or in [-20, 19]'; '' when it has none beyond its type."""
    tp = info.annotation
    if typing.get_origin(tp) is Literal:
        return f"one of {sorted(typing.get_args(tp))}"
    lo = hi = None
    for m in info.metadata:
        if isinstance(m, at.MinLen) and m.min_length == 1:
            return "non-empty"
        if isinstance(m, at.Gt):
            lo = ("(", ">", m.gt)
        elif isinstance(m, at.Ge):
            lo = ("[", ">=", m.ge)
        elif isinstance(m, at.Lt):
            hi = (")", "<", m.lt)
        elif isinstance(m, at.Le):
            hi = ("]", "<=", m.le)
    if lo and hi:
        text = f"in {lo[0]}{lo[2]:g}, {hi[2]:g}{hi[0]}"
    elif lo or hi:
        text = f"{(lo or hi)[1]} {(lo or hi)[2]:g}"
    else:
        return ""
    return f"null or {text}" if type(None) in typing.get_args(tp) else text


def _submodel(info):
    tp = info.annotation if info is not None else None
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _is_policy_union(info) -> bool:
    return info is not None and any(isinstance(m, Discriminator) for m in info.metadata)


def locate(root: type, loc: tuple) -> tuple:
    """(key path, the model holding its last key, that key's FieldInfo) of an error's loc below
    `root`. The policy union puts the policy's name in the loc after `policy`: that is no key,
    but names the settings model that holds the rest."""
    path, owner, info, model, tagged = "", None, None, root, False
    for part in loc:
        if tagged:
            model, tagged = (REGISTRY[part].settings if part in REGISTRY else None), False
            continue
        if isinstance(part, int):
            path, owner, info, model = f"{path}[{part}]", None, None, None
            continue
        key = _key(part)
        path = f"{path}.{key}" if path else key
        owner, info = model, (model.model_fields.get(part) if model is not None else None)
        model, tagged = _submodel(info), _is_policy_union(info)
    return path, owner, info


_NAME = re.compile(r"[A-Za-z_][\w-]{0,63}")


def _key(part) -> str:
    """A key as a path shows it: a plain name as it is, any other key JSON-quoted (and cut at 64
    characters), so that a key like '\\' or 'a.b' cannot be read as part of the path's syntax."""
    text = str(part)
    if _NAME.fullmatch(text):
        return text
    return json.dumps(text[:64]) + ("..." if len(text) > 64 else "")


def _unknown_key(path: str, owner, key) -> str:
    if owner is not None and issubclass(owner, PolicySettings):
        mine, others = owner.model_fields["name"].default, owners_of(key)
        if others:
            return f"{path}: a setting of policy {' or '.join(map(repr, others))}, not of {mine!r}"
    known = ", ".join(sorted(owner.model_fields)) if owner is not None else "?"
    return f"{path}: unknown key (known: {known})"


def _message(err: dict, root: type, prefix: tuple) -> str:
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    path, owner, info = locate(root, prefix + tuple(err["loc"]))
    if kind == "extra_forbidden":
        return _unknown_key(path, owner, str(err["loc"][-1]))
    if kind == "invalid_key":  # YAML allows any scalar as a key (1.5, null, .inf)
        return f"{path}: unknown key (a key is a string)"
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        if not isinstance(value, dict):
            return f"{path}={shown(value)}: must be a mapping"
        return f"{path}.name={shown(value.get('name'))}: must be one of {sorted(POLICY_NAMES)}"
    if kind == "value_error" and isinstance(ctx.get("error"), FieldRuleError):
        e = ctx["error"]
        return f"{path + '.' if path else ''}{e.key}={shown(e.value)}: must be {e.rule}"
    if info is not None and info.annotation is float and type(value) is int and abs(value) < 2**1000:
        value = float(value)  # as the field would hold it
    if isinstance(value, LongInteger):  # (a literal too long to read: parsing.py)
        why = INT_RULE
    elif kind in _BOUNDS and info is not None and rule_of(info):
        why = f"must be {rule_of(info)}"
    else:
        why = _TYPES.get(kind, err["msg"])
    return f"{path}={shown(value)}: {why}" if path else why


def config_error(e: ValidationError, root: type, prefix: tuple = ()) -> ConfigError:
    """`e`, raised validating `root` (at `prefix` below ClusterConfig), as one ConfigError."""
    return ConfigError("; ".join(_message(err, root, prefix) for err in e.errors()))
