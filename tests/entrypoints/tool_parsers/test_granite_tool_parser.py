"""The ``granite`` tool-call parser (Granite 3.0/3.1), whole and streamed.

Cases ported from vLLM's tests/tool_parsers/test_granite_tool_parser.py and the common suite it runs
(tests/tool_parsers/common_tests.py), written out here as data. Each whole case is also streamed in
pieces of every size and in token-like pieces, which must give the same content and calls. Where
vLLM's cases split the text with Granite's tokenizer, the pieces here are cut by hand.
"""
from __future__ import annotations

import json

import pytest
from _utils_yours_b import names_args, stream, token_pieces, whole_and_streamed

from pagellm.entrypoints.openai.tool_parsers import get_tool_parser
from pagellm.entrypoints.openai.tool_parsers.granite import MARKERS, GraniteToolParser

SINGLE = '<|tool_call|> [{"name": "get_weather", "arguments": {"city": "Tokyo"}}]'
PARALLEL = """<|tool_call|> [
  {"name": "get_weather", "arguments": {"city": "Tokyo"}},
  {"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}
]"""
VARIOUS_TYPES = """<tool_call> [{
  "name": "test_function",
  "arguments": {
    "string_field": "hello",
    "int_field": 42,
    "float_field": 3.14,
    "bool_field": true,
    "null_field": null,
    "array_field": ["a", "b", "c"],
    "object_field": {"nested": "value"},
    "empty_array": [],
    "empty_object": {}
  }
}]"""
ESCAPED = """<tool_call> [{
  "name": "test_function",
  "arguments": {
    "quoted": "He said \\"hello\\"",
    "path": "C:\\\\Users\\\\file.txt",
    "newline": "line1\\nline2",
    "unicode": "emoji: 🎉"
  }
}]"""

# The common suite's cases that give calls: text -> [(name, arguments)].
CALL_CASES = {
    "single_tool_call_simple_args": (SINGLE, [("get_weather", {"city": "Tokyo"})]),
    "parallel_tool_calls": (PARALLEL, [("get_weather", {"city": "Tokyo"}), ("get_time", {"timezone": "Asia/Tokyo"})]),
    "various_data_types": (VARIOUS_TYPES, [("test_function", {
        "string_field": "hello", "int_field": 42, "float_field": 3.14, "bool_field": True, "null_field": None,
        "array_field": ["a", "b", "c"], "object_field": {"nested": "value"}, "empty_array": [], "empty_object": {},
    })]),
    "empty_arguments": ('<|tool_call|> [{"name": "refresh", "arguments": {}}]', [("refresh", {})]),
    "escaped_strings": (ESCAPED, [("test_function", {
        "quoted": 'He said "hello"', "path": "C:\\Users\\file.txt", "newline": "line1\nline2", "unicode": "emoji: 🎉",
    })]),
    # Granite-specific: 3.0's special token, and 3.1's plain-text tag.
    "granite_token_prefix_format": (SINGLE, [("get_weather", {"city": "Tokyo"})]),
    "granite_string_prefix_format": (
        '<tool_call> [{"name": "get_weather", "arguments": {"city": "Tokyo"}}]', [("get_weather", {"city": "Tokyo"})]
    ),
}
# vLLM's common cases that give no calls from this parser: the text is all content.
CONTENT_CASES = {
    "no_tool_calls": "This is a regular response without any tool calls.",
    # vLLM marks the common "surrounding text" case xfail for granite (both modes): a reply that does
    # not begin with the calls is content, text after the list too.
    "surrounding_text": 'Let me check the weather for you.\n<|tool_call|> [{"name": "get_weather", "arguments": {"city": "Tokyo"}}]\n'
                        "I'll get that information.",
    "malformed_unclosed": '<|tool_call|> [{"name": "func", "arguments": {',
    "malformed_not_an_array": '<|tool_call|> {"name": "func", "arguments": {}}',
    "malformed_arguments_not_an_object": '[{"name": "func", "arguments": "not a dict"}]',
    "malformed_text_first": 'Some text [{"name": "func"}]',
}


def tokens(text: str) -> list[str]:
    return token_pieces(text, MARKERS)


@pytest.mark.parametrize("case", CALL_CASES)
def test_calls(case):
    text, expected = CALL_CASES[case]
    whole = whole_and_streamed(GraniteToolParser, text, MARKERS)
    # Granite drops the marker: no content when there are calls.
    assert whole.content is None and names_args(whole) == expected
    ids = [c.id for c in whole.tool_calls]
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("case", CONTENT_CASES)
def test_content(case):
    text = CONTENT_CASES[case]
    whole = whole_and_streamed(GraniteToolParser, text, MARKERS)
    assert whole.content == text and whole.tool_calls == []


def test_streaming_reconstruction():
    whole = GraniteToolParser().extract(SINGLE)
    got = stream(GraniteToolParser, tokens(SINGLE))
    assert got.content == "" and whole.content is None  # vLLM's xfail here: its stream kept the marker
    assert got.calls == [(c.name, c.arguments) for c in whole.tool_calls]


@pytest.mark.parametrize("text", [SINGLE, PARALLEL])
def test_streaming_split_invariance(text):
    baseline = stream(GraniteToolParser, tokens(text))
    toks = tokens(text)
    for cut in range(1, len(toks)):  # every two-piece batching of the tokens
        got = stream(GraniteToolParser, ["".join(toks[:cut]), "".join(toks[cut:])])
        assert (got.content, got.calls) == (baseline.content, baseline.calls), cut


ARGS_BEFORE_NAME = (
    '<|tool_call|> [{"arguments": {"city": "Tokyo"}, "name": "get_weather"}, '
    '{"arguments": {"timezone": "Asia/Tokyo"}, "name": "get_time"}]'
)


@pytest.mark.parametrize("chunk_size", [2, 3, 4, 5])
def test_streaming_parallel_calls_batched_deltas(chunk_size):
    # vLLM cuts with Granite 3.1's tokenizer; token-like pieces batched chunk_size at a time here.
    toks = tokens(ARGS_BEFORE_NAME)
    got = stream(GraniteToolParser, ["".join(toks[i : i + chunk_size]) for i in range(0, len(toks), chunk_size)])
    assert [name for name, _ in got.calls] == ["get_weather", "get_time"]
    assert json.loads(got.calls[0][1]) == {"city": "Tokyo"} and json.loads(got.calls[1][1]) == {"timezone": "Asia/Tokyo"}


def test_streaming_parallel_calls_single_delta():
    text = '<|tool_call|>[{"name": "get_weather", "arguments": {"x": 42}}, {"name": "b", "arguments": {"y": 7}}]'
    got = stream(GraniteToolParser, [text])
    assert [(n, json.loads(a)) for n, a in got.calls] == [("get_weather", {"x": 42}), ("b", {"y": 7})]


# pagellm's own cases.
OWN_CALLS = {
    "no_marker": ('[{"name": "f", "arguments": {"a": 1}}]', [("f", {"a": 1})]),
    "both_markers_and_space": ('\n<|tool_call|>\n<tool_call>[{"name": "f", "arguments": {}}]\n', [("f", {})]),
    "arguments_as_json_text": ('<tool_call>[{"name": "f", "arguments": "{\\"a\\": [1, 2]}"}]', [("f", {"a": [1, 2]})]),
    "three_calls": ('<|tool_call|>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"k": "v, ]"}}, '
                    '{"name": "c", "arguments": {"n": -1.5e3}}]', [("a", {}), ("b", {"k": "v, ]"}), ("c", {"n": -1500.0})]),
}
OWN_CONTENT = [
    "", "   ", "<|tool_call|>", "<tool", "[]", '<|tool_call|>[{"name": "f"}]', '<|tool_call|>[{"arguments": {}}]',
    '<|tool_call|>[{"name": "f", "arguments": {}}] trailing words', '<|tool_call|>[{"name": "f", "arguments": {"x": NaN}}]',
    '<|tool_call|>[{"name": "f", "arguments": {"x": 1e999}}]', '[1, 2, 3] are numbers', "[citation needed]",
]


@pytest.mark.parametrize("case", OWN_CALLS)
def test_own_calls(case):
    text, expected = OWN_CALLS[case]
    whole = whole_and_streamed(GraniteToolParser, text, MARKERS)
    assert whole.content is None and names_args(whole) == expected


@pytest.mark.parametrize("text", OWN_CONTENT)
def test_own_content(text):
    whole = whole_and_streamed(GraniteToolParser, text, MARKERS)
    assert whole.content == text and whole.tool_calls == []


def test_plain_text_and_first_calls_stream_early():
    parser = GraniteToolParser()
    assert parser.extract_streaming("<", False).content == ""  # may begin <|tool_call|>
    assert parser.extract_streaming("b>Bold</b>", False).content == "<b>Bold</b>"
    parser = GraniteToolParser()
    delta = parser.extract_streaming('<tool_call>[{"name": "a", "arguments": {}}, {"name": "b', False)
    assert delta.content == "" and [(i, c.name) for i, c in delta.tool_calls] == [(0, "a")]
    assert get_tool_parser("granite") is GraniteToolParser


def test_a_bad_item_after_a_sent_call():
    # The first call went out before the bad item came; the end of the reply makes it all content.
    text = '<|tool_call|>[{"name": "f", "arguments": {}}, 7]'
    assert GraniteToolParser().extract(text).content == text
    got = stream(GraniteToolParser, [text[:-3], text[-3:]])
    assert got.content == text and got.calls == [("f", "{}")]
