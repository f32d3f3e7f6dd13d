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
from yaml.constructor import ConstructorError
from yaml.nodes import MappingNode, SequenceNode

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
    except (ValueError, RecursionError):
        text = f"<{type(value).__name__} nested too deeply>"
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


class ConfigLoader(yaml.SafeLoader):
    """yaml.SafeLoader with the rules above. Aliases stay allowed (a config may share a block with
    an anchor or a merge key `<<: *base`); what is bounded is the document they expand to."""

    def compose_document(self):
        node = super().compose_document()
        _check_expansion(node)
        return node

    def construct_mapping(self, node, deep=False):
        if isinstance(node, MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # merged keys may be overridden
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:  # unhashable: SafeLoader refuses it
                    continue
                if duplicate:
                    raise ConstructorError("while constructing a mapping", node.start_mark,
                                           f"found duplicate key {shown(key)}", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node):
        text = str(node.value).replace("_", "")
        if len(text) > MAX_INT_DIGITS:
            return LongInteger(len(text.lstrip("+-")))
        return super().construct_yaml_int(node)


ConfigLoader.add_constructor("tag:yaml.org,2002:int", ConfigLoader.construct_yaml_int)


def _check_expansion(root) -> None:
    """Refuse a node graph (aliases share nodes) whose expansion exceeds MAX_YAML_NODES nodes, or
    that contains itself. Each node is counted once, by its expanded size: linear in the graph."""
    if root is None:
        return
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
                raise ConstructorError(None, None, f"aliases expand to more than {MAX_YAML_NODES:,} values "
                                       "(a config holds a few hundred)", node.start_mark)
            continue
        if key in sizes:
            continue
        if key in open_:
            raise ConstructorError(None, None, "an alias refers to the node that holds it", node.start_mark)
        open_.add(key)
        stack.append((node, True))
        stack.extend((k, False) for k in kids if id(k) not in sizes)


def _children(node) -> list:
    if isinstance(node, MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, SequenceNode):
        return list(node.value)
    return []


def load_yaml(text: str):
    """yaml.load with ConfigLoader: raises yaml.YAMLError (also for the rules above)."""
    return yaml.load(text, Loader=ConfigLoader)  # noqa: S506 (a SafeLoader)
