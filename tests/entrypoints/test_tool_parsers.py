"""The hermes tool-call parser, whole and streamed in pieces of every size."""
from __future__ import annotations

import json

import pytest

from pagellm.entrypoints.openai.tool_parsers import HermesToolParser, get_tool_parser

TEXT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)


def test_extract_content_and_calls():
    parsed = HermesToolParser().extract(TEXT)
    assert parsed.content == "Let me check.\n"
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}),
        ("get_time", {"tz": "CET"}),
    ]
    assert parsed.tool_calls[0].id != parsed.tool_calls[1].id
    assert HermesToolParser().extract("no tools here").tool_calls == []
    bad = "<tool_call>\n{not json}\n</tool_call>"
    assert HermesToolParser().extract(bad).content == bad and HermesToolParser().extract(bad).tool_calls == []
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("no-such-parser")


@pytest.mark.parametrize("step", [1, 2, 3, 7, 50, len(TEXT)])
def test_streamed_pieces_reassemble_to_the_whole(step):
    parser = HermesToolParser()
    content, calls = "", []
    pieces = [TEXT[i : i + step] for i in range(0, len(TEXT), step)]
    for i, piece in enumerate(pieces):
        delta = parser.extract_streaming(piece, finished=i == len(pieces) - 1)
        content += delta.content
        calls += [(idx, c.name, c.arguments) for idx, c in delta.tool_calls]
        assert "<tool" not in delta.content
    whole = HermesToolParser().extract(TEXT)
    assert content == whole.content
    assert calls == [(i, c.name, c.arguments) for i, c in enumerate(whole.tool_calls)]


def test_streamed_text_without_calls_and_a_broken_call():
    parser = HermesToolParser()
    out = "".join(parser.extract_streaming(p, f).content for p, f in [("a <to", False), ("ol", False), (" b", True)])
    assert out == "a <tool b"
    parser = HermesToolParser()
    d1 = parser.extract_streaming("x<tool_call>{bad", False)
    d2 = parser.extract_streaming("", True)
    assert d1.content + d2.content == "x<tool_call>{bad" and not d1.tool_calls and not d2.tool_calls
