"""The content format a chat template takes, as vLLM 0.32 detects it ("auto", its default:
renderers/hf.py `_detect_content_format` over the template's Jinja syntax tree):

- "openai": the template loops over a message's content (`{% for part in message['content'] %}`,
  through filters, tests and slices, from any name assigned from `messages` or one of its
  messages, from a macro parameter a message's content is passed to, or over a variable named
  `content` outside a macro), so it is handed each message's content as a list of parts;
- "string": it is not (or does not parse): it is handed the parts' texts joined.
tests/test_content_format.py compares with vLLM's detection.
"""
from __future__ import annotations

from collections import deque
from functools import lru_cache
from typing import Iterator, Literal

from .chat_jinja import chat_environment

ContentFormat = Literal["string", "openai"]


class _Unreadable(Exception):
    """A construct vLLM's walk stops on (an assertion there): the template's format is the default."""


@lru_cache(maxsize=32)
def content_format(template: str) -> ContentFormat:
    """"openai" when `template` loops over a message's content parts, else "string"."""
    from jinja2 import nodes

    try:
        ast = chat_environment().parse(template)
    except Exception:  # vLLM logs it and keeps the default
        return "string"
    try:
        next(_content_loops(ast, nodes))
    except StopIteration:
        return "string"
    except (_Unreadable, RecursionError):
        return "string"
    return "openai"


def _reads(node, var: str, key, nodes) -> bool:
    """`node` reads `var` (its `key` when one is given), through filters, tests and slices."""
    if isinstance(node, nodes.Filter):
        return node.node is not None and _reads(node.node, var, key, nodes)
    if isinstance(node, nodes.Test):
        return _reads(node.node, var, key, nodes)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _reads(node.node, var, key, nodes)
    if key is not None:  # var[key] or var.key, on the name itself
        if isinstance(node, nodes.Getitem):
            return _loads(node.node, var, nodes) and isinstance(node.arg, nodes.Const) and node.arg.value == key
        return isinstance(node, nodes.Getattr) and _loads(node.node, var, nodes) and node.attr == key
    return _loads(node, var, nodes)


def _loads(node, var: str, nodes) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == var


def _target(node, nodes) -> str:
    if not isinstance(node, nodes.Name):
        raise _Unreadable
    return node.name


def _aliases(root, var: str, nodes) -> list[str]:
    """`var` and each name assigned from it, or from such a name (breadth first)."""
    names, queue, seen = [var], deque([var]), {var}
    while queue:
        current = queue.popleft()
        for assign in root.find_all(nodes.Assign):
            if _reads(assign.node, current, None, nodes):
                name = _target(assign.target, nodes)
                names.append(name)
                if name not in seen:  # (vLLM loops forever on a cycle of assignments)
                    seen.add(name)
                    queue.append(name)
    return names


def _message_names(root, nodes) -> list[str]:
    """The targets of the loops over the messages (or a name assigned from them)."""
    sources = _aliases(root, "messages", nodes)
    found = []
    for loop in root.find_all(nodes.For):
        if any(_reads(loop.iter, name, None, nodes) for name in sources):
            found.append(_target(loop.target, nodes))
    return found


def _content_loops(root, nodes) -> Iterator[str]:
    """The targets of the loops over a message's content, as vLLM's _iter_nodes_assign_content_item finds them."""
    messages = _message_names(root, nodes)
    reads_content = lambda node: any(_reads(node, m, "content", nodes) for m in messages)  # noqa: E731
    macro_params: dict[int, set[str]] = {}  # a loop in a macro: the macro's parameters given a message's content
    in_macros: set[int] = set()
    for macro in root.find_all(nodes.Macro):
        names = {arg.name for arg in macro.args}
        given: set[str] = set()
        for call in root.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            given.update(macro.args[i].name for i, arg in enumerate(call.args)
                         if i < len(macro.args) and reads_content(arg))
            given.update(kw.key for kw in call.kwargs
                         if isinstance(kw, nodes.Keyword) and kw.key in names and reads_content(kw.value))
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if given:
                macro_params[id(loop)] = given
    for loop in root.find_all(nodes.For):
        it = loop.iter
        if reads_content(it):
            yield _target(loop.target, nodes)
        elif isinstance(it, nodes.Name) and it.name in macro_params.get(id(loop), ()):
            yield _target(loop.target, nodes)
        elif id(loop) not in in_macros and isinstance(it, nodes.Name) and it.name == "content":
            yield _target(loop.target, nodes)
