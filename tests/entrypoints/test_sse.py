"""Server-sent events as the OpenAI server writes them."""
from __future__ import annotations

import json

from pydantic import BaseModel

from pagellm.entrypoints.openai.serving_base import sse, sse_error


class Chunk(BaseModel):
    text: str


def test_unicode_line_breaks_are_escaped_so_line_splitting_clients_keep_the_event_whole() -> None:
    text = "one\u2028two\x85three\u2029four\n\"é\""
    event = sse(Chunk(text=text))
    assert event.endswith("\n\n") and event.startswith("data: ")
    lines = event.splitlines()  # what httpx's aiter_lines() and many clients do
    assert lines == [event[: -2], ""]
    assert json.loads(lines[0][len("data: "):]) == {"text": text}
    assert "é" in event  # only the three line breaks are escaped


def test_error_event_is_openai_shaped() -> None:
    event = sse_error(ValueError("bad\u2028input"))
    body = json.loads(event.splitlines()[0][len("data: "):])
    assert body["error"]["message"] == "bad\u2028input" and body["error"]["code"] == 400
