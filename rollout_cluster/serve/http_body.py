"""Reading an HTTP body within a byte limit, as a stream (the Gateway's routes share it)."""
from __future__ import annotations

from typing import Optional

from fastapi import Request


async def read_bounded(request: Request, max_bytes: int) -> Optional[bytes]:
    """The body, read as a stream; None as soon as it passes `max_bytes` (a Content-Length past
    it is refused before a byte is read)."""
    if _declares_more(request.headers.get("content-length", ""), max_bytes):
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _declares_more(value: str, max_bytes: int) -> bool:
    """Whether a Content-Length says more than `max_bytes` bytes. ASCII digits only: "²" passes
    str.isdigit() and int() refuses it (any other value is no length: the body is bounded as it
    streams); more digits than max_bytes has (leading zeros aside) is more, unread by int(),
    which refuses 4,300 digits."""
    if not (value.isascii() and value.isdigit()):
        return False
    digits = value.lstrip("0")
    return len(digits) > len(str(max_bytes)) or int(digits or "0") > max_bytes
