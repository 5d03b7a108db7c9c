"""The ``granite4`` tool-call parser (Granite 4.0 / 4.0-H), whole and streamed.

Cases ported from vLLM's tests/tool_parsers/test_granite4_tool_parser.py, written out here as data:
vLLM streams them only; here each reply is also parsed whole, and streamed in pieces of every size
and in token-like pieces, which must give the same content and calls. vLLM's random chunking is
kept (seeded) for its four chunk-size ranges. The cases after those are pagellm's own.
"""
from __future__ import annotations

import json
import random

import pytest
from _utils_yours_b import names_args, stream, token_pieces, whole_and_streamed

from pagellm.entrypoints.openai.tool_parsers import get_tool_parser
from pagellm.entrypoints.openai.tool_parsers.granite4 import TC_END, TC_START, Granite4ToolParser

P = Granite4ToolParser
BBOX = {"coordinates": [[23.54, 43.1], [-12.2, 54.3], [4, 5]], "coordinate_type": "latlong"}
STOCK = {"symbol": "AAPL", "start_date": "2021-01-01", "end_date": "2021-12-31"}
EXPECTED_CALLS = [("find_bbox", BBOX), ("get_stock_price", STOCK), ("find_bbox", BBOX)]
TEXTS = ["Here goes the bbox call: \n", " Now the stock price call: \n ", " Now another bbox call: \n ", " See? I'm a helpful assistant."]


def block(name: str, arguments: object) -> str:
    return f"{TC_START} {json.dumps({'name': name, 'arguments': arguments})} {TC_END}"


def complex_reply(string_args: bool) -> str:
    """Text, a call, text, a call, text, a call, text; bbox arguments as a JSON string when asked
    (as Granite writes them)."""
    bbox = json.dumps(BBOX) if string_args else BBOX
    calls = [block("find_bbox", bbox), block("get_stock_price", STOCK), block("find_bbox", bbox)]
    return TEXTS[0] + calls[0] + TEXTS[1] + calls[1] + TEXTS[2] + calls[2] + TEXTS[3]


def tokens(text: str) -> list[str]:
    return token_pieces(text, [TC_START, TC_END])


# --- vLLM's cases ---------------------------------------------------------------------------------


def test_complex_whole_and_every_piece_size():
    # vLLM's test_tool_call_parser_complex reply, whole; then every piece size covers its chunk ranges.
    whole = whole_and_streamed(P, complex_reply(string_args=True), [TC_START, TC_END])
    assert whole.content == "".join(TEXTS)
    assert names_args(whole) == EXPECTED_CALLS


@pytest.mark.parametrize("min_chunk, max_chunk", [(1, 1), (1, 2), (5, 7), (6, 20)])
def test_complex_random_chunks(min_chunk: int, max_chunk: int):
    text = complex_reply(string_args=True)
    rng = random.Random(42 + 100 * min_chunk + max_chunk)
    for _ in range(5):
        pieces, i = [], 0
        while i < len(text):
            size = rng.randint(min_chunk, max_chunk)
            pieces.append(text[i : i + size])
            i += size
        got = stream(P, pieces)
        assert got.content == "".join(TEXTS)
        assert [(name, json.loads(args)) for name, args in got.calls] == EXPECTED_CALLS


def test_content_between_calls_completed_in_one_delta():
    # vLLM's regression: a call that starts and ends in one delta, then content and a call in the next.
    deltas = [
        '<tool_call> {"name": "find_bbox", "arguments": {}} </tool_call>',
        'some explanation <tool_call> {"name": "get_stock_price", "arguments": {}} </tool_call>',
    ]
    got = stream(P, deltas)
    assert got.content == "some explanation "
    assert [name for name, _ in got.calls] == ["find_bbox", "get_stock_price"]
    whole = whole_and_streamed(P, "".join(deltas), [TC_START, TC_END])
    assert whole.content == "some explanation "
    assert names_args(whole) == [("find_bbox", {}), ("get_stock_price", {})]


# --- pagellm's own cases --------------------------------------------------------------------------


def test_registered():
    assert get_tool_parser("granite4") is Granite4ToolParser


def test_object_arguments_and_no_content():
    # Arguments written as an object; a reply of calls (and space) alone has no content.
    text = f"\n{block('find_bbox', BBOX)}\n{block('get_stock_price', STOCK)}\n"
    whole = whole_and_streamed(P, text, [TC_START, TC_END])
    assert whole.content is None
    assert names_args(whole) == [("find_bbox", BBOX), ("get_stock_price", STOCK)]
    assert names_args(P().extract(complex_reply(string_args=False))) == EXPECTED_CALLS


def test_unicode_and_escapes_kept():
    args = {"city": "Zürich", "note": 'He said "hi"\n', "emoji": "🎉"}
    text = "Sure. " + f"{TC_START}{json.dumps({'name': 'note', 'arguments': args}, ensure_ascii=False)}{TC_END}"
    whole = whole_and_streamed(P, text, [TC_START, TC_END])
    assert whole.content == "Sure. "
    assert names_args(whole) == [("note", args)]
    assert "Zürich" in whole.tool_calls[0].arguments


@pytest.mark.parametrize(
    "text",
    [
        "A plain answer, no tools.",
        "I would write <tool_ but then I don't.",
        "",
        "  \n ",
        # Malformed: the whole reply stays content, as in vLLM.
        f'{TC_START} {{"name": "f", "arguments": {{}}}}',  # unclosed
        f"{TC_START}{TC_END}",  # empty
        f"{TC_START}  {TC_END}",  # space only
        f'{TC_START} {TC_START} {{"name": "f", "arguments": {{}}}} {TC_END}',  # a start inside a block
        f'{TC_END} {TC_START} {{"name": "f", "arguments": {{}}}} {TC_END}',  # an end with no block open
        f'{TC_START} {{"name": "f"}} {TC_END}',  # no arguments (vLLM needs the key)
        f'{TC_START} {{"name": "f", "parameters": {{}}}} {TC_END}',
        f'{TC_START} [{{"name": "f", "arguments": {{}}}}] {TC_END}',  # a list, not a call
        # Stricter than vLLM, which would send these arguments as they are (not a JSON object):
        f'{TC_START} {{"name": "f", "arguments": "not json"}} {TC_END}',
        f'{TC_START} {{"name": "f", "arguments": [1, 2]}} {TC_END}',
        f'{TC_START} {{"name": "f", "arguments": {{"x": NaN}}}} {TC_END}',
        f'{TC_START} {{"name": 7, "arguments": {{}}}} {TC_END}',
    ],
)
def test_content_only(text: str):
    whole = whole_and_streamed(P, text, [TC_START, TC_END])
    assert whole.tool_calls == []
    assert whole.content == text


def test_bad_block_after_a_good_one():
    # Whole: all content, as in vLLM. Streamed: the good call has gone out when its block closed
    # (vLLM streams it too), and the text from the first block on follows as content at the end.
    text = f'Hi {TC_START} {{"name": "f", "arguments": {{}}}} {TC_END} then {TC_START} {{"name": "g", "arguments": {{"a": }} {TC_END}'
    whole = P().extract(text)
    assert whole.tool_calls == [] and whole.content == text
    for size in (1, 7, len(text) // 2):
        got = stream(P, [text[i : i + size] for i in range(0, len(text), size)])
        assert got.calls == [("f", "{}")]
        assert got.content == text


def test_held_back_marker_then_sent():
    parser = P()
    assert parser.extract_streaming("Let me check <tool", finished=False).content == "Let me check "
    delta = parser.extract_streaming('_call> {"name": "f", "arguments": "{\\"a\\": 1}"} </tool_call>', finished=False)
    assert delta.content == "" and [(i, c.name, json.loads(c.arguments)) for i, c in delta.tool_calls] == [(0, "f", {"a": 1})]
    assert parser.extract_streaming(" done", finished=True).content == " done"


def test_token_pieces_of_complex():
    got = stream(P, tokens(complex_reply(string_args=True)) + [""])
    assert got.content == "".join(TEXTS)
    assert [(name, json.loads(args)) for name, args in got.calls] == EXPECTED_CALLS
