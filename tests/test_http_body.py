"""read_bounded (serve/http_body.py) at the function level. Regression: a Content-Length of
non-ASCII digits ("²", which latin-1 headers can carry) passed str.isdigit() and int() raised
ValueError (a 500); so did 5,000 ASCII digits (past Python's int string limit). Uvicorn may
refuse such a header first, but the check must not rely on it: only ASCII digits are a length."""
import asyncio

import pytest
from starlette.requests import Request

BODY = b'{"prompt": [1, 2]}'


def request(content_length: str | None, body: bytes = BODY) -> Request:
    headers = [] if content_length is None else [(b"content-length", content_length.encode("latin-1"))]
    sent = []

    async def receive():
        if sent:
            return {"type": "http.disconnect"}
        sent.append(1)
        return {"type": "http.request", "body": body, "more_body": False}
    return Request({"type": "http", "method": "POST", "path": "/", "headers": headers}, receive)


def read(content_length, max_bytes=1024, body=BODY):
    from rollout_cluster.serve.http_body import read_bounded

    return asyncio.run(read_bounded(request(content_length, body), max_bytes))


@pytest.mark.parametrize("declared", ["²", "¹²", "³", "1²", " 18", "18 ", "+18", "-1", "0x12", "1_8", "", None])
def test_content_length_of_superscript_digits_is_no_length(declared):
    # not a declared length: the body is read as a stream, within the limit
    assert read(declared) == BODY


def test_a_content_length_past_the_limit_is_refused_before_reading():
    assert read(str(len(BODY))) == BODY
    assert read("1025") is None
    assert read("9" * 5000) is None  # past int()'s 4,300-digit limit: still a length, and past max_bytes
    assert read("0" * 5000 + "18") == BODY  # leading zeros: 18


def test_a_streamed_body_past_the_limit_is_refused_whatever_it_declared():
    assert read("²", max_bytes=4) is None
    assert read("3", max_bytes=4) is None
