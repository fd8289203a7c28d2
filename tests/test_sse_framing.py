"""Server-sent events stay one line per `data:` whatever text they carry.

SSE ends lines only at CR and LF, but clients that split with str.splitlines() semantics, as httpx's
`iter_lines` / `aiter_lines` do, also break at U+0085, U+2028 and U+2029, which JSON leaves raw inside
strings. A model can write any of them, so the server escapes them; the reference here is httpx's own
line decoder reading the bytes the server writes.
"""

from __future__ import annotations

import json

import httpx

from deepinfer.core.server.chat_adapter import named_sse
from deepinfer.core.server.serving import sse

TEXT = "a\u2028b\x85c\u2029d\ne\r\"é\u00a0f"  # the three splitlines-only breaks, CR / LF, quote, non-ASCII


def client_lines(body: str) -> list[str]:
    response = httpx.Response(200, content=body.encode(), headers={"content-type": "text/event-stream"})
    return [line for line in response.iter_lines() if line]


def test_openai_style_event_is_one_line_for_httpx_and_keeps_the_text():
    payload = {"choices": [{"text": TEXT, "index": 0}]}
    lines = client_lines(sse(payload) + sse("[DONE]"))
    assert lines[-1] == "data: [DONE]" and len(lines) == 2, lines
    assert json.loads(lines[0].removeprefix("data: ")) == payload
    assert "é" in lines[0]  # UTF-8 kept, not \u-escaped


def test_named_event_is_two_lines_for_httpx_and_keeps_the_text():
    payload = {"type": "content_block_delta", "delta": {"type": "text_delta", "text": TEXT}}
    lines = client_lines(named_sse("content_block_delta", payload))
    assert lines[0] == "event: content_block_delta" and len(lines) == 2, lines
    assert json.loads(lines[1].removeprefix("data: ")) == payload
