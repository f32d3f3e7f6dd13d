"""Jinja as transformers compiles a chat template (chat_template_utils._compile_jinja_template),
which vLLM's server renders with: a sandbox that trims blocks, loop controls, the `{% generation %}`
block (its body rendered as any other: we track no assistant spans), and transformers' globals and
filters (`raise_exception`, `strftime_now`, a `tojson` that does not escape HTML and takes
json.dumps' keywords). codec.render_chat renders with it; content_format parses with it."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache


@lru_cache(maxsize=1)
def chat_environment():
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, "jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)
