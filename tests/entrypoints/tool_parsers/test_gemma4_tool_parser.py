"""The ``gemma4`` tool-call parser, whole and streamed, and its reader of Gemma 4's value syntax.

Cases ported from vLLM's tests/tool_parsers/test_gemma4_tool_parser.py, written out here as data:
its argument and array reader cases, its whole-reply cases, and its streamed cases with their own
pieces. Each whole reply is also streamed in pieces of every size and in token-like pieces, which
must give the same content and calls.
"""
from __future__ import annotations

import json

import pytest
from _utils_yours_b import names_args, stream, whole_and_streamed

from pagellm.entrypoints.openai.tool_parsers import get_tool_parser
from pagellm.entrypoints.openai.tool_parsers.gemma4 import (
    STRING_DELIM,
    TOOL_CALL_END,
    TOOL_CALL_START,
    Gemma4ToolParser,
    parse_gemma4_args,
    parse_gemma4_array,
)

Q = STRING_DELIM  # <|"|>
SPECIALS = (TOOL_CALL_START, TOOL_CALL_END, STRING_DELIM)

# vLLM's TestParseGemma4Args (full, not streaming, reading): text -> dict.
ARGS = {
    "empty_string": ("", {}),
    "whitespace_only": ("   ", {}),
    "single_string_value": (f"location:{Q}Paris{Q}", {"location": "Paris"}),
    "string_value_with_comma": (f"location:{Q}Paris, France{Q}", {"location": "Paris, France"}),
    "multiple_string_values": (f"location:{Q}San Francisco{Q},unit:{Q}celsius{Q}", {"location": "San Francisco", "unit": "celsius"}),
    "integer_value": ("count:42", {"count": 42}),
    "float_value": ("score:3.14", {"score": 3.14}),
    "boolean_true": ("flag:true", {"flag": True}),
    "boolean_false": ("flag:false", {"flag": False}),
    "null_value": ("param:null", {"param": None}),
    "mixed_types": (f"name:{Q}test{Q},count:42,active:true,score:3.14", {"name": "test", "count": 42, "active": True, "score": 3.14}),
    "nested_object": (f"nested:{{inner:{Q}value{Q}}}", {"nested": {"inner": "value"}}),
    "string_delimited_dict_key": (f"record_map:{{{Q}3{Q}:{Q}new text{Q}}}", {"record_map": {"3": "new text"}}),
    "nested_string_delimited_dict_key": (f"outer:{{inner:{{{Q}3{Q}:{Q}new text{Q}}}}}", {"outer": {"inner": {"3": "new text"}}}),
    "array_of_strings": (f"items:[{Q}a{Q},{Q}b{Q}]", {"items": ["a", "b"]}),
    "unterminated_string": (f"key:{Q}unterminated", {"key": "unterminated"}),
    "empty_value": ("key:", {"key": ""}),
    # vLLM's trailing-dot case, its whole-reading half (the other half is its streaming reader's).
    "trailing_dot_float": ("left:108.,right:22.8", {"left": 108.0, "right": 22.8}),
}
# vLLM's TestParseGemma4Array: text -> list.
ARRAYS = {
    "string_array": (f"{Q}a{Q},{Q}b{Q}", ["a", "b"]),
    "empty_array": ("", []),
    "bare_values": ("42,true,3.14", [42, True, 3.14]),
    "string_element_with_closing_bracket": (f"[{Q}a]b{Q},{Q}c{Q}],{Q}tail{Q}", [["a]b", "c"], "tail"]),
    "stray_closing_bracket": ("42,]trailing", [42]),
}


@pytest.mark.parametrize("case", ARGS)
def test_parse_args(case):
    text, expected = ARGS[case]
    assert parse_gemma4_args(text) == expected
    json.dumps(expected)


@pytest.mark.parametrize("case", ARRAYS)
def test_parse_array(case):
    text, expected = ARRAYS[case]
    assert parse_gemma4_array(text) == expected


def test_malformed_partial_array_ends():
    assert isinstance(parse_gemma4_args(":[t:[]"), dict)  # vLLM: must not hang


def call(name: str, args: str) -> str:
    return f"{TOOL_CALL_START}call:{name}{{{args}}}{TOOL_CALL_END}"


# vLLM's TestExtractToolCalls: reply -> (content, [(name, arguments)]); content None: only calls.
EXTRACT = {
    "single_tool_call": (call("get_weather", f"location:{Q}London{Q}"), None, [("get_weather", {"location": "London"})]),
    "multiple_arguments": (call("get_weather", f"location:{Q}San Francisco{Q},unit:{Q}celsius{Q}"), None,
                           [("get_weather", {"location": "San Francisco", "unit": "celsius"})]),
    # vLLM strips the content to "Let me check the weather for you."; pagellm keeps it as written,
    # since that is what a stream sends before it knows a call follows.
    "text_before_tool_call": ("Let me check the weather for you. " + call("get_weather", f"location:{Q}Paris{Q}"),
                              "Let me check the weather for you. ", [("get_weather", {"location": "Paris"})]),
    "multiple_tool_calls": (call("get_weather", f"location:{Q}London{Q}") + call("get_time", f"location:{Q}London{Q}"), None,
                            [("get_weather", {"location": "London"}), ("get_time", {"location": "London"})]),
    "nested_arguments": (call("complex_function", f"nested:{{inner:{Q}value{Q}}},list:[{Q}a{Q},{Q}b{Q}]"), None,
                         [("complex_function", {"nested": {"inner": "value"}, "list": ["a", "b"]})]),
    "tool_call_with_number_and_boolean": (call("set_status", "is_active:true,count:42,score:3.14"), None,
                                          [("set_status", {"is_active": True, "count": 42, "score": 3.14})]),
    "hyphenated_function_name": (call("get-weather", f"location:{Q}London{Q}"), None, [("get-weather", {"location": "London"})]),
    "dotted_function_name": (call("weather.get", f"location:{Q}London{Q}"), None, [("weather.get", {"location": "London"})]),
    "no_arguments": (call("get_status", ""), None, [("get_status", {})]),
}
NO_CALLS = {
    "no_tool_calls": "Hello, how can I help you today?",
    "incomplete_tool_call": f"{TOOL_CALL_START}call:get_weather{{location:{Q}London",
}


@pytest.mark.parametrize("case", EXTRACT)
def test_extract(case):
    text, content, expected = EXTRACT[case]
    whole = whole_and_streamed(Gemma4ToolParser, text, SPECIALS)
    assert whole.content == content and names_args(whole) == expected


@pytest.mark.parametrize("case", NO_CALLS)
def test_extract_no_calls(case):
    text = NO_CALLS[case]
    whole = whole_and_streamed(Gemma4ToolParser, text, SPECIALS)
    assert whole.content == text and whole.tool_calls == []


# vLLM's TestStreamingExtraction: its pieces -> (content, [(name, arguments)]).
STREAMED = {
    "basic_streaming_single_tool": (
        [TOOL_CALL_START, "call:get_weather{", f"location:{Q}Paris", ", France", f"{Q}}}", TOOL_CALL_END],
        "", [("get_weather", {"location": "Paris, France"})]),
    "streaming_multi_arg": (
        [TOOL_CALL_START, "call:get_weather{", f"location:{Q}Tokyo{Q},", f"unit:{Q}celsius{Q}}}", TOOL_CALL_END],
        "", [("get_weather", {"location": "Tokyo", "unit": "celsius"})]),
    # Three of vLLM's cases stream this same reply, checking for no extra "}", quoted keys, no "call:".
    "streaming_no_extra_brace": (
        [TOOL_CALL_START, "call:get_weather{", f"location:{Q}London{Q}}}", TOOL_CALL_END], "", [("get_weather", {"location": "London"})]),
    "streaming_no_unquoted_keys": (
        [TOOL_CALL_START, "call:get_weather{", f"location:{Q}Paris{Q}}}", TOOL_CALL_END], "", [("get_weather", {"location": "Paris"})]),
    "streaming_name_no_call_prefix": (
        [TOOL_CALL_START, "call:get_weather{", f"location:{Q}Paris{Q}}}", TOOL_CALL_END], "", [("get_weather", {"location": "Paris"})]),
    "streaming_text_before_tool_call": (
        ["Let me check ", "the weather. ", TOOL_CALL_START, "call:get_weather{", f"location:{Q}London{Q}}}", TOOL_CALL_END],
        "Let me check the weather. ", [("get_weather", {"location": "London"})]),
    "streaming_numeric_args": (
        [TOOL_CALL_START, "call:set_config{", "count:42,", "active:true}", TOOL_CALL_END],
        "", [("set_config", {"count": 42, "active": True})]),
    "streaming_boolean_split_across_chunks": (
        [TOOL_CALL_START, "call:search{input:{all:tru", "e}}", TOOL_CALL_END], "", [("search", {"input": {"all": True}})]),
    "streaming_false_split_across_chunks": ([TOOL_CALL_START, "call:set{flag:fals", "e}", TOOL_CALL_END], "", [("set", {"flag": False})]),
    "streaming_number_split_across_chunks": ([TOOL_CALL_START, "call:set{count:4", "2}", TOOL_CALL_END], "", [("set", {"count": 42})]),
    "streaming_empty_args": ([TOOL_CALL_START, "call:get_status{}", TOOL_CALL_END], "", [("get_status", {})]),
    "streaming_split_delimiter_no_invalid_json": (
        [TOOL_CALL_START, "call:todowrite{", f"content:{Q}Buy milk<|", '"|>}', TOOL_CALL_END],
        "", [("todowrite", {"content": "Buy milk"})]),
    # After the call, plain text is content, sent once ("<div>", not "<<div>").
    "streaming_does_not_duplicate_plain_text_after_tool_call": (
        [TOOL_CALL_START, "call:get_weather{", f"location:{Q}Paris{Q}}}", f"{TOOL_CALL_END}<", "div>"],
        "<div>", [("get_weather", {"location": "Paris"})]),
    "streaming_html_argument_does_not_duplicate_tag_prefixes": (
        [TOOL_CALL_START, "call:write_file{", f"path:{Q}index.html{Q},", f"content:{Q}<!DOCTYPE html>\n<", 'html lang="zh-CN">\n<',
         "head>\n    <", 'meta charset="UTF-8">\n    <', 'meta name="viewport" content="width=device-width">\n', f"{Q}}}", TOOL_CALL_END],
        "", [("write_file", {"path": "index.html", "content": '<!DOCTYPE html>\n<html lang="zh-CN">\n<head>\n    <meta charset="UTF-8">\n'
                                                                 '    <meta name="viewport" content="width=device-width">\n'})]),
    "streaming_trailing_bare_bool_not_duplicated": (
        [TOOL_CALL_START, "call:Edit{", f"file_path:{Q}src/env.py{Q},", f"old_string:{Q}old_val{Q},", f"new_string:{Q}new_val{Q},",
         "replace_all:", "false}", TOOL_CALL_END],
        "", [("Edit", {"file_path": "src/env.py", "old_string": "old_val", "new_string": "new_val", "replace_all": False})]),
}


@pytest.mark.parametrize("case", STREAMED)
def test_streamed(case):
    pieces, content, expected = STREAMED[case]
    got = stream(Gemma4ToolParser, pieces)
    assert got.content == content
    assert [(name, json.loads(args)) for name, args in got.calls] == expected
    for _, args in got.calls:
        assert "<|" not in args and args.count("call:") == 0
    # And the same reply in pieces of every size.
    whole = whole_and_streamed(Gemma4ToolParser, "".join(pieces), SPECIALS)
    assert (whole.content or "") == content and names_args(whole) == expected


# pagellm's own cases.
OWN = {
    "text_between_and_after_is_content": (
        "Checking. " + call("a", "x:1") + "\n" + call("b", f"y:{Q}two{Q}") + " Done.",
        "Checking. \n Done.", [("a", {"x": 1}), ("b", {"y": "two"})]),
    "unfinished_call_after_a_call_is_content": (
        call("a", "") + f"{TOOL_CALL_START}call:b{{x:", f"{TOOL_CALL_START}call:b{{x:", [("a", {})]),
    "string_with_braces_and_markup": (call("w", f"s:{Q}a}}b{{c [x]{Q},n:-2,e:1e5,big:1.5e999,none:None"), None,
                                      [("w", {"s": "a}b{c [x]", "n": -2, "e": "1e5", "big": "1.5e999", "none": None})]),
    "nested_arrays_and_objects": (
        call("f", f"a:[[1,2],[{{k:{Q}v{Q}}}]],o:{{p:{{q:[]}}}}"), None, [("f", {"a": [[1, 2], [{"k": "v"}]], "o": {"p": {"q": []}}})]),
    "unicode": (call("say", f"text:{Q}héllo ☃ \"quoted\" \\ back{Q}"), None, [("say", {"text": 'héllo ☃ "quoted" \\ back'})]),
}


@pytest.mark.parametrize("case", OWN)
def test_own(case):
    text, content, expected = OWN[case]
    whole = whole_and_streamed(Gemma4ToolParser, text, SPECIALS)
    assert whole.content == content and names_args(whole) == expected


def test_content_streams_up_to_a_possible_marker():
    parser = Gemma4ToolParser()
    assert parser.extract_streaming("Sure <|tool", False).content == "Sure "
    assert parser.extract_streaming("_call>call:f{}", False).content == ""
    delta = parser.extract_streaming(TOOL_CALL_END, False)
    assert [(i, c.name, c.arguments) for i, c in delta.tool_calls] == [(0, "f", "{}")]
    assert get_tool_parser("gemma4") is Gemma4ToolParser
