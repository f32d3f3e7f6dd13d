"""A conversation's messages as vLLM 0.32 hands them to the chat template, for text: what
vllm/renderers/chat_utils.py's `_parse_chat_message_content` and `_postprocess_messages` make of
them in the template's content format (text/content_format.py detects it as vLLM does), after the
checks its request model (ChatCompletionRequest.messages) makes, and with hf.py's
developer-to-system conversion for a template that has no developer role.
tests/test_chat_messages.py and tests/test_content_format.py compare with vLLM's own parsing.

- content, "string" format (a template that does not loop over parts): a string, a list of text
  parts (their texts joined with "\n", empty ones skipped, as vLLM joins them), missing (""), or
  null on an assistant message (""); "openai" format (a template that loops over
  `message.content`): a list of parts, a string as one text part, each text part (refusal,
  thinking, input/output text) as {"type": "text", "text": ...} with its other keys, a
  tool_reference as {"type", "name"}, empty texts kept, missing or null content []; a tool
  result's text parts joined with "\n" in either; an image, audio, video or file part refused by name;
- assistant: `tool_calls` kept (an empty list dropped), each call's `function.arguments` (OpenAI's
  JSON string) parsed to the dict a tool-aware template expects, `{}` when it is empty, malformed
  or not a JSON object; `reasoning` (or the deprecated `reasoning_content`) as both;
- tool: `tool_call_id` kept; every message: `name` kept; `task` kept when a string; a developer
  message its `tools`; any other key dropped (vLLM's ConversationMessage holds no other).
Whatever vLLM's server refuses is refused here, naming the field (`messages[1].tool_calls[0].id`).
"""
from __future__ import annotations

import json
from typing import Optional

from .context import ProtocolError

# a text part's type -> the key that holds its text (vllm chat_utils.MM_PARSER_MAP's text parsers)
TEXT_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
             "thinking": "thinking", "tool_reference": "name"}
# the part types that carry media (vLLM's multimodal parts, and OpenAI's file part it does not take)
MEDIA_TYPES = {"image_url", "input_image", "image_pil", "image_embeds", "audio_url", "input_audio", "audio_embeds",
               "video_url", "video_embeds", "prompt_embeds", "file"}
BILLING_HEADER = "x-anthropic-billing-header"  # a system text's first line vLLM drops (Claude Code's, per request)
# a content part's keys that vLLM's "openai" format does not carry over (its _KNOWN_CONTENT_PART_FIELDS)
PART_KEYS = {"audio_embeds", "audio_url", "closed", "data", "file", "image_embeds", "image_pil", "image_url",
             "input_audio", "name", "prompt_cache_breakpoint", "refusal", "text", "thinking", "type", "uuid",
             "video_embeds", "video_url"}


def template_messages(messages, param: str, template: Optional[str] = None,
                      content_format: str = "string") -> list[dict]:
    """`messages` (a request's conversation) as vLLM hands them to the chat template `template`,
    whose content format is `content_format` ("string" or "openai"); ProtocolError (400) naming
    the first field vLLM's server refuses too."""
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ProtocolError(400, f"{param}: must be a non-empty list of messages", param)
    parts = content_format == "openai"
    conversation = [_message(m, f"{param}[{i}]", parts) for i, m in enumerate(messages)]
    if template is not None and any(m["role"] == "developer" for m in conversation) and not (
            '"developer"' in template or "'developer'" in template):
        conversation = _consolidate_system([_as_system(m) for m in conversation])
    return conversation


def _refuse(field: str, value, why: str):
    shown = repr(value)
    raise ProtocolError(400, f"{field}={shown[:80] + '...' if len(shown) > 80 else shown}: {why}", field)


def _message(m: dict, at: str, parts: bool) -> dict:
    """One message as vLLM's _parse_chat_message_content writes it (`parts`: the "openai" content
    format, else the "string" one)."""
    role, content = m.get("role"), m.get("content")
    if not isinstance(role, str):
        _refuse(f"{at}.role", role, "must be a string")
    if content is None and "content" in m and role != "assistant":
        _refuse(f"{at}.content", None, "null content is taken on an assistant message only (as vLLM's server)")
    if content is None and "content" in m and "tool_calls" in m and m["tool_calls"] is None:
        _refuse(f"{at}.tool_calls", None, "with null content, tool_calls must be a list or absent (as vLLM's server)")
    out = {"role": role, "content": (_parts if parts else _text)(content, role, f"{at}.content")}
    if parts and role == "tool" and all(p["type"] == "text" for p in out["content"]):
        out["content"] = "\n".join(p["text"] for p in out["content"])  # templates take a tool result as a string
    if role == "assistant":
        calls = m.get("tool_calls")
        if calls is not None and (calls := _tool_calls(calls, f"{at}.tool_calls")):
            out["tool_calls"] = calls
        reasoning, field = m.get("reasoning"), "reasoning"
        if reasoning is None:  # vLLM's request model renames the deprecated field
            reasoning, field = m.get("reasoning_content"), "reasoning_content"
        if reasoning is not None:
            if not isinstance(reasoning, str):
                _refuse(f"{at}.{field}", reasoning, "must be a string")
            out["reasoning"] = out["reasoning_content"] = reasoning
    elif role == "tool" and "tool_call_id" in m:
        if not isinstance(m["tool_call_id"], (str, type(None))):
            _refuse(f"{at}.tool_call_id", m["tool_call_id"], "must be a string")
        out["tool_call_id"] = m["tool_call_id"]
    if "name" in m:
        if not isinstance(m["name"], str):
            _refuse(f"{at}.name", m["name"], "must be a string")
        out["name"] = m["name"]
    if isinstance(m.get("task"), str):
        out["task"] = m["task"]
    if role == "developer":
        out["tools"] = m.get("tools")
    return out


def _text(content, role: str, at: str) -> str:
    """A message's content as one string: its text parts' texts joined with "\n" (vLLM's string
    format), empty texts skipped; a system message's Claude Code header line dropped as vLLM drops it."""
    if content is None:
        return ""
    if isinstance(content, str):
        parts = [content]
    elif isinstance(content, list):
        parts = content
    else:
        return _refuse(at, content, "must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(parts):
        text = _part_text(part, f"{at}[{j}]")
        if role == "system" and text.startswith(BILLING_HEADER) and (
                isinstance(part, str) or part.get("type") == "text"):
            text = text.partition("\n")[2]
        texts.append(text)
    return "\n".join(t for t in texts if t)


def _parts(content, role: str, at: str) -> list:
    """A message's content as a list of parts (vLLM's "openai" format): a string is one text part;
    a system text part's Claude Code header line dropped, and the part with it when nothing is left."""
    if content is None:
        return []
    if not isinstance(content, (str, list)):
        return _refuse(at, content, "must be a string or a list of text parts")
    out = []
    for j, part in enumerate([content] if isinstance(content, str) else content):
        text = _part_text(part, f"{at}[{j}]")
        if isinstance(part, str):
            part = {"type": "text", "text": part}
        if role == "system" and text.startswith(BILLING_HEADER) and part.get("type") == "text":
            text = text.partition("\n")[2]
            if not text:
                continue
        if part.get("type") == "tool_reference":
            out.append({"type": "tool_reference", "name": part.get("name")})
        else:
            out.append({"type": "text", "text": text, **{k: v for k, v in part.items() if k not in PART_KEYS}})
    return out


def _part_text(part, at: str) -> str:
    """One content part's text (a string part is its own); a media part or an unknown type refused."""
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        return _refuse(at, part, "a content part must be a string or an object with a type")
    kind = part.get("type")
    if not isinstance(kind, (str, type(None))):
        _refuse(f"{at}.type", kind, "must be a string")
    if kind in MEDIA_TYPES or (kind is None and any(k in part for k in MEDIA_TYPES)):
        _refuse(at, kind or next(k for k in MEDIA_TYPES if k in part), "only text parts are supported (no images, "
                "audio, video or files)")
    if kind not in TEXT_KEYS:
        _refuse(f"{at}.type", kind, f"not a text part type (one of {', '.join(TEXT_KEYS)})")
    if part.get("uuid") is not None:  # vLLM reads a part with a uuid as a media item
        _refuse(f"{at}.uuid", part["uuid"], "a uuid is for media parts (vLLM refuses it on text)")
    key = TEXT_KEYS[kind]
    text = part.get(key)
    if kind == "tool_reference" and text is None:  # vLLM skips it
        return ""
    if not isinstance(text, str):
        _refuse(f"{at}.{key}", text, f"a {kind!r} part needs a string {key!r}")
    return text


def _tool_calls(calls, at: str) -> list:
    """An assistant's tool calls as vLLM's _postprocess_messages leaves them: function calls only,
    each `function.arguments` parsed from its JSON string; any other key kept as it came."""
    if not isinstance(calls, list):
        _refuse(at, calls, "must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        where = f"{at}[{j}]"
        if not isinstance(call, dict):
            _refuse(where, call, "a tool call must be an object")
        if call.get("type") != "function":
            _refuse(f"{where}.type", call.get("type"), "chat completions take tool calls of type 'function' only")
        if not isinstance(call.get("id"), str):
            _refuse(f"{where}.id", call.get("id"), "must be a string")
        function = call.get("function")
        if not isinstance(function, dict):
            _refuse(f"{where}.function", function, "must be an object with a name and arguments")
        if not isinstance(function.get("name"), str):
            _refuse(f"{where}.function.name", function.get("name"), "must be a string")
        if not isinstance(function.get("arguments"), str):
            _refuse(f"{where}.function.arguments", function.get("arguments"),
                    "must be a string holding the arguments as JSON (OpenAI's format)")
        out.append({**call, "function": {**function, "arguments": _arguments(function["arguments"],
                                                                              f"{where}.function.arguments")}})
    return out


def _arguments(text: str, at: str) -> dict:
    """A tool call's arguments as vLLM parses them: the JSON object, else {} (empty, malformed or
    not an object: vLLM keeps the conversation going rather than fail every later turn)."""
    if not text:
        return {}
    try:
        parsed = json.loads(text)
    except ValueError:
        return {}
    except RecursionError:  # vLLM would fail with a 500 here
        return _refuse(at, text, "the JSON is nested too deeply")
    return parsed if isinstance(parsed, dict) else {}


def _as_system(m: dict) -> dict:
    """hf.py's _convert_developer_to_system: a developer message as a system one, without its tools."""
    if m["role"] != "developer":
        return m
    return {**{k: v for k, v in m.items() if k != "tools"}, "role": "system"}


def _consolidate_system(conversation: list[dict]) -> list[dict]:
    """hf.py's _consolidate_system_messages: the system messages merged into one at the start when
    there are several or one that is not first (some templates need the system message first)."""
    systems, others, merge = [], [], False
    for i, m in enumerate(conversation):
        if m["role"] != "system":
            others.append(m)
            continue
        merge = merge or i > 0 or bool(systems)
        content = m["content"]
        if isinstance(content, list):  # the "openai" format's parts: their texts
            content = "\n".join(p if isinstance(p, str) else p["text"] for p in content
                                 if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
        if content:
            systems.append(content)
    return [{"role": "system", "content": "\n\n".join(systems)}, *others] if merge else conversation
