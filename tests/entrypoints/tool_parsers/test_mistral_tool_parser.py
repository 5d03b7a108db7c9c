"""The mistral tool-call parser, whole and streamed: vLLM's cases (tests/tool_parsers/test_mistral_tool_parser.py) rewritten
as data, streamed in pieces of every size (one piece among them: vLLM's one-chunk cases) instead of through the
Mistral tokenizers, and a few of ours."""

from __future__ import annotations

import json

import pytest
from _utils_yours_a import Case, check_streamed, check_whole

from pagellm.entrypoints.openai.tool_parsers import get_tool_parser
from pagellm.entrypoints.openai.tool_parsers.mistral import MistralToolParser, is_mistral_call_id

WEATHER = {"city": "Porto", "country": "PT", "unit": "c"}
W = json.dumps(WEATHER)
BASH = {"command": "echo \"hi there\"\nre.compile(r'{}')"}
BASH_TEXT = r'{"command": "echo \"hi there\"\nre.compile(r' + "'{}')" + '"}'
assert json.loads(BASH_TEXT) == BASH

NO_TOOLS = Case("no_tools", "Just a test", [], "Just a test")

# Before v11: [TOOL_CALLS] and a JSON array of {"name", "arguments"}.
PRE_V11_WHOLE = [
    Case("pre_v11_single_tool_add", '[TOOL_CALLS][{"name": "add", "arguments":{"a": 1.5, "b": 7}}]', [("add", {"a": 1.5, "b": 7})], None),
    Case("pre_v11_single_tool_weather", f'[TOOL_CALLS] [{{"name": "get_weather", "arguments":{W}}}]', [("get_weather", WEATHER)], None),
    Case("pre_v11_argument_before_name", f'[TOOL_CALLS] [{{"arguments":{W}, "name": "get_weather"}}]', [("get_weather", WEATHER)], None),
    Case(
        "pre_v11_argument_before_name_and_name_in_argument",
        '[TOOL_CALLS] [{"arguments":{"name": "Ada L"}, "name": "get_age"}]',
        [("get_age", {"name": "Ada L"})],
        None,
    ),
]
PRE_V11_STREAMED = [
    NO_TOOLS,
    Case(
        "pre_v11_single_tool_add", '[TOOL_CALLS]  [ {"name":"add" , "arguments" : {"a": 2, "b": 5} } ]', [("add", {"a": 2, "b": 5})], None
    ),
    Case(
        "pre_v11_single_tool_add_strings",
        '[TOOL_CALLS] [{"name": "add", "arguments":{"a": "2", "b": "5"}}]',
        [("add", {"a": "2", "b": "5"})],
        None,
    ),
    Case("pre_v11_single_tool_weather", f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {W}}}]', [("get_weather", WEATHER)], None),
    Case("pre_v11_argument_before_name", f'[TOOL_CALLS] [{{"arguments": {W}, "name": "get_weather"}}]', [("get_weather", WEATHER)], None),
    Case(
        "pre_v11_argument_before_name_and_name_in_argument",
        '[TOOL_CALLS] [{"arguments": {"name": "Ada L"}, "name": "get_age"}]',
        [("get_age", {"name": "Ada L"})],
        None,
    ),
    Case(
        "pre_v11_multiple_tools",
        f'[TOOL_CALLS] [{{"name": "add", "arguments": {{"a": 1.5, "b": 7}}}}, {{"name": "get_weather", "arguments":{W}}}]',
        [("add", {"a": 1.5, "b": 7}), ("get_weather", WEATHER)],
        None,
    ),
]
PRE_V11_ONE_CHUNK = PRE_V11_STREAMED[:-1] + [
    Case(
        "pre_v11_multiple_tools_arguments_first",
        f'[TOOL_CALLS] [{{"arguments": {{"a": 1.5, "b": 7}}, "name": "add"}}, {{"arguments":{W}, "name": "get_weather"}}]',
        [("add", {"a": 1.5, "b": 7}), ("get_weather", WEATHER)],
        None,
    )
]

# v11 and newer: [TOOL_CALLS]NAME{json} per call.
V11_ADD = Case("v11_single_tool_add", '[TOOL_CALLS]add_two{"a": 1.5, "b": 7}', [("add_two", {"a": 1.5, "b": 7})], None)
V11_WEATHER = Case("v11_single_tool_weather", f"[TOOL_CALLS]get_weather{W}", [("get_weather", WEATHER)], None)
V11_MULTIPLE = Case(
    "v11_multiple_tool_calls",
    '[TOOL_CALLS]add{"a": 1.5, "b": 7}[TOOL_CALLS]multiply{"a": 2, "b": 9}',
    [("add", {"a": 1.5, "b": 7}), ("multiply", {"a": 2, "b": 9})],
    None,
)
V11_BASH = Case("v11_complex", "hi{hi[TOOL_CALLS]bash" + BASH_TEXT, [("bash", BASH)], "hi{hi")
# vLLM returns this cut-off call with its broken arguments; pagellm returns arguments that are JSON or none: content.
V11_TRUNCATED = Case(
    "v11_complex_truncated_arguments", "hi{hi[TOOL_CALLS]bash" + BASH_TEXT[:-2], [], "hi{hi[TOOL_CALLS]bash" + BASH_TEXT[:-2]
)
V11_WHOLE = [V11_ADD, V11_WEATHER, V11_MULTIPLE, V11_TRUNCATED, Case("v11_wrong_json", V11_BASH.text, V11_BASH.calls, "hi{hi")]
# vLLM streams these through the v13 tokenizer, which writes [ARGS] between the name and the arguments.
V11_STREAMED = [
    Case("v13_single_tool_add", '[TOOL_CALLS]add[ARGS]{"a": 2, "b": 5}', [("add", {"a": 2, "b": 5})], None),
    Case(
        "v13_single_tool_add_strings",
        '[TOOL_CALLS]add_two_strings[ARGS]{"a": "2", "b": "5"}',
        [("add_two_strings", {"a": "2", "b": "5"})],
        None,
    ),
    Case(
        "v13_multiple_tools",
        f'[TOOL_CALLS]add[ARGS]{{"a": 1.5, "b": 7}}[TOOL_CALLS]get_weather[ARGS]{W}',
        [("add", {"a": 1.5, "b": 7}), ("get_weather", WEATHER)],
        None,
    ),
]
V11_ONE_CHUNK = [
    V11_ADD,
    V11_WEATHER,
    V11_MULTIPLE,
    Case("v11_content_before_tool", 'bla[TOOL_CALLS]add_two{"a": 1.5, "b": 7}', [("add_two", {"a": 1.5, "b": 7})], "bla"),
    V11_BASH,
]

VLLM_WHOLE = [NO_TOOLS] + PRE_V11_WHOLE + V11_WHOLE  # 10
VLLM_STREAMED = PRE_V11_STREAMED + V11_STREAMED + V11_ONE_CHUNK + PRE_V11_ONE_CHUNK  # 22

OURS = [
    Case("call_id", '[TOOL_CALLS]add[CALL_ID]a1B2c3D4e[ARGS]{"a": 1}', [("add", {"a": 1})], None),
    Case("whitespace_before_calls", ' \n[TOOL_CALLS]add{"a": 1}', [("add", {"a": 1})], None),
    Case("text_after_array_ignored", '[TOOL_CALLS][{"name": "f", "arguments": {}}] done', [("f", {})], None),
    Case("text_after_object_ignored", '[TOOL_CALLS]f{"a": [1, "}"]} </s>', [("f", {"a": [1, "}"]})], None),
    Case("empty_last_tool_calls_skipped", '[TOOL_CALLS]f{"a": 1}[TOOL_CALLS]', [("f", {"a": 1})], None),
    Case("tool_calls_alone_is_content", "so [TOOL_CALLS] ", [], "so [TOOL_CALLS] "),
    Case("name_with_space_is_content", '[TOOL_CALLS]my tool{"a": 1}', [], '[TOOL_CALLS]my tool{"a": 1}'),
    Case("item_without_arguments_is_content", '[TOOL_CALLS][{"name": "f"}]', [], '[TOOL_CALLS][{"name": "f"}]'),
    Case(
        "arguments_not_an_object_is_content",
        '[TOOL_CALLS][{"name": "f", "arguments": 3}]',
        [],
        '[TOOL_CALLS][{"name": "f", "arguments": 3}]',
    ),
    Case("call_cut_by_next_tool_calls_is_content", '[TOOL_CALLS]f{"a": [TOOL_CALLS]g{}', [], '[TOOL_CALLS]f{"a": [TOOL_CALLS]g{}'),
]


@pytest.mark.parametrize("case", VLLM_WHOLE + OURS, ids=lambda c: c.id)
def test_whole(case):
    parsed = MistralToolParser().extract(case.text)
    check_whole(parsed, case)
    for call, (_, args) in zip(parsed.tool_calls, case.calls):
        assert is_mistral_call_id(call.id)
        assert call.arguments == json.dumps(args)  # vLLM compares the argument text itself


@pytest.mark.parametrize("case", VLLM_STREAMED + OURS, ids=lambda c: c.id)
def test_streamed(case):
    assert check_streamed(MistralToolParser, case, id_check=is_mistral_call_id) > 1


def test_model_call_id_kept_and_registry():
    assert get_tool_parser("mistral") is MistralToolParser
    assert MistralToolParser().extract(OURS[0].text).tool_calls[0].id == "a1B2c3D4e"
    assert not is_mistral_call_id("call-1234") and not is_mistral_call_id("abcdefgh")
