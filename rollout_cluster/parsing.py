"""Untrusted text into plain data, bounded: a JSONL request line (client/jsonl.py) and a YAML
config file (config/). The parsers refuse what no field could hold, so that a bad input is one
error naming what is wrong, never an exception that loses the other lines:
- a key given twice in one object or mapping (the last would silently win);
- an integer literal of more than MAX_INT_DIGITS digits becomes a LongInteger, which every field
  refuses by name (Python's int() raises for over 4,300 digits, and would fail the whole input);
- nesting deeper than the parser's recursion (JSON: NestingError);
- YAML aliases that expand to more than MAX_YAML_NODES nodes, or refer to themselves: a
  few hundred bytes of aliases can expand to millions of values that validation would walk.
NaN, Infinity and numbers beyond a double's range parse as floats: the field that holds one
refuses it as not finite. `shown` is the one bounded repr that error messages use.
"""
from __future__ import annotations

import json

import yaml
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

MAX_INT_DIGITS = 40  # past any 64-bit value: no field takes more
MAX_YAML_NODES = 10_000  # a config holds a few hundred values; aliases may not expand past this


class LongInteger:
    """An integer literal of more than MAX_INT_DIGITS digits, kept as its length."""

    __slots__ = ("digits",)

    def __init__(self, digits: int):
        self.digits = digits

    def __repr__(self) -> str:
        return f"<integer of {self.digits} digits>"


class DuplicateKeyError(ValueError):
    """A JSON object gives `key` twice."""

    def __init__(self, key: str, value):
        super().__init__(f"duplicate key {key!r}")
        self.key, self.value = key, value


class NestingError(ValueError):
    """The JSON text nests deeper than the parser's recursion limit."""


def shown(value, limit: int = 80) -> str:
    """repr(value), cut to `limit` characters. Never raises: an int over 4,300 digits and deep
    nesting have no repr."""
    if isinstance(value, int) and value.bit_length() > 3 * MAX_INT_DIGITS:  # its repr may not exist
        return f"<integer of about {int(value.bit_length() * 0.30103) + 1} digits>"
    try:
        text = repr(value)
    except RecursionError:
        text = f"<{type(value).__name__} nested too deeply>"
    except Exception:  # (an object from a driver whose repr fails)
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _json_int(text: str):
    return LongInteger(len(text.lstrip("-"))) if len(text) > MAX_INT_DIGITS else int(text)


def _unique_keys(pairs: list) -> dict:
    out = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(key, value)
        out[key] = value
    return out


def load_json(text: str):
    """json.loads with the rules above: raises json.JSONDecodeError, DuplicateKeyError or NestingError."""
    try:
        return json.loads(text, object_pairs_hook=_unique_keys, parse_int=_json_int)
    except RecursionError:
        raise NestingError("nested too deeply") from None


class RefusedYAML(yaml.YAMLError):
    """A YAML document the rules above refuse (one line: where, and why)."""


class ConfigLoader(yaml.SafeLoader):
    """yaml.SafeLoader with the rules above. Aliases stay allowed (a config may share a block with
    an anchor or a merge key `<<: *base`); what is bounded is the document they expand to."""

    def compose_document(self):
        node = super().compose_document()
        if node is not None:
            _check_expansion(node)
            _check_unique_keys(node)
        return node

    def construct_yaml_int(self, node):
        text = str(node.value).replace("_", "")
        if len(text) > MAX_INT_DIGITS:
            return LongInteger(len(text.lstrip("+-")))
        return super().construct_yaml_int(node)


ConfigLoader.add_constructor("tag:yaml.org,2002:int", ConfigLoader.construct_yaml_int)


def _line(node) -> int:
    return node.start_mark.line + 1


def _check_expansion(root) -> None:
    """Refuse a node graph (aliases share nodes) whose expansion exceeds MAX_YAML_NODES nodes, or
    that contains itself. Each node is counted once, by its expanded size: linear in the graph."""
    sizes: dict = {}
    open_: set = set()  # nodes entered, not finished: the current path
    stack = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        kids = _children(node)
        if finished:
            open_.discard(key)
            sizes[key] = 1 + sum(sizes[id(k)] for k in kids)
            if sizes[key] > MAX_YAML_NODES:
                raise RefusedYAML(f"line {_line(node)}: aliases expand to more than {MAX_YAML_NODES:,} values "
                                  "(a config holds a few hundred)")
            continue
        if key in sizes:
            continue
        if key in open_:
            raise RefusedYAML(f"line {_line(node)}: an alias refers to the node that holds it")
        open_.add(key)
        stack.append((node, True))
        stack.extend((k, False) for k in kids if id(k) not in sizes)


def _children(node) -> list:
    if isinstance(node, MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, SequenceNode):
        return list(node.value)
    return []


def _check_unique_keys(root) -> None:
    """Refuse a mapping that gives a key twice (PyYAML keeps the last), naming its key path.
    Runs after _check_expansion: the expanded document is small. A merge key's values (`<<`)
    may be overridden, as YAML means them to be."""
    stack = [(root, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, SequenceNode):
            stack.extend((n, f"{path}[{i}]") for i, n in enumerate(node.value))
            continue
        if not isinstance(node, MappingNode):
            continue
        seen: dict = {}
        for key, value in node.value:
            if key.tag == "tag:yaml.org,2002:merge":
                continue
            name = f"{path}.{key.value}" if path else str(key.value)
            if isinstance(key, ScalarNode):
                if (key.tag, key.value) in seen:
                    raise RefusedYAML(f"{name}: key given twice (lines {seen[(key.tag, key.value)]} and "
                                      f"{_line(key)}): which one is meant?")
                seen[(key.tag, key.value)] = _line(key)
            stack.append((value, name))


def load_yaml(text: str):
    """yaml.load with ConfigLoader: raises yaml.YAMLError (also for the rules above)."""
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 (a SafeLoader)
