"""Reading an HTTP body within a byte limit, as a stream (the Gateway's routes share it)."""
from __future__ import annotations

from typing import Optional

from fastapi import Request


async def read_bounded(request: Request, max_bytes: int) -> Optional[bytes]:
    """The body, read as a stream; None as soon as it passes `max_bytes` (a Content-Length past
    it is refused before a byte is read)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            return None
        chunks.append(chunk)
    return b"".join(chunks)
