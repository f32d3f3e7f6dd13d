"""A request's body as a JSON object: read within limits.max_body_bytes, a key given twice, nesting
too deep and lone UTF-16 surrogates refused by name."""
from __future__ import annotations

import re

from ...config import LimitsConfig
from ...parsing import DuplicateKeyError, NestingError, load_json, shown
from ..http_body import read_bounded
from .context import ProtocolError


async def read_json(request, limits: LimitsConfig) -> dict:
    """The body as a JSON object, read within limits.max_body_bytes; ProtocolError otherwise."""
    body = await read_bounded(request, limits.max_body_bytes)
    if body is None:
        raise ProtocolError(413, f"the body is larger than limits.max_body_bytes={limits.max_body_bytes}")
    try:
        text = body.decode("utf-8")
        obj = load_json(text)
    except DuplicateKeyError as e:
        raise ProtocolError(400, f"{e.key} is given twice in one object", e.key) from None
    except NestingError:
        raise ProtocolError(400, "the body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(400, f"the body is not valid JSON ({type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise ProtocolError(400, "the body must be a JSON object")
    if "\\u" in text:  # only a \u escape makes a surrogate: valid UTF-8 holds none
        _refuse_surrogates(obj)
    return obj


SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads joins a pair into one character: any left is alone


def _refuse_surrogates(obj) -> None:
    """ProtocolError naming the first string (or key) of `obj` that holds a lone UTF-16 surrogate
    (JSON's "\\ud800"): no text, which the tokenizer refuses with a TypeError and an answer that
    echoes it cannot encode as UTF-8 (both were 500s). Strings are checked where they lie; only
    non-empty containers are stacked."""
    stack = [(obj, "")]
    while stack:
        value, where = stack.pop()
        for key, item in (value.items() if isinstance(value, dict) else enumerate(value)):
            if isinstance(key, str) and SURROGATE.search(key):
                raise ProtocolError(400, f"{where or 'body'}: the key {shown(key)} holds a lone UTF-16 surrogate, "
                                         "not text", where or None)
            if isinstance(item, str) and SURROGATE.search(item):
                name = _member(where, key)
                raise ProtocolError(400, f"{name}={shown(item)}: holds a lone UTF-16 surrogate, not text", name)
            if isinstance(item, (dict, list)) and item:
                stack.append((item, _member(where, key)))


def _member(where: str, key) -> str:
    if isinstance(key, int):
        return f"{where}[{key}]"
    return f"{where}.{key}" if where else key
