"""The qwen3_coder tool-call parser, whole and streamed: vLLM's cases (tests/tool_parsers/test_qwen3coder_tool_parser.py)
rewritten as data, streamed in pieces of every size instead of through the Qwen3-Coder tokenizer, and a few of ours."""

from __future__ import annotations

import json

import pytest
from _utils_yours_a import Case, check_streamed, check_whole

from pagellm.entrypoints.openai.tool_parsers import get_tool_parser
from pagellm.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser


def _tool(name: str, properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties}}}


TOOLS = [
    _tool("get_weather", {"city": {"type": "string"}, "region": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}}),
    _tool("area_of", {"shape": {"type": "string"}, "dims": {"type": "object"}, "digits": {"type": "integer"}}),
]
TYPED_TOOLS = [
    _tool(
        "typed",
        {
            "an_int": {"type": "integer"},
            "a_float": {"type": "float"},
            "a_bool": {"type": "boolean"},
            "a_str": {"type": "string"},
            "an_obj": {"type": "object"},
        },
    )
]


def _call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


LYON = _call("get_weather", city="Lyon", region="ARA", unit="c")
LYON_ARGS = {"city": "Lyon", "region": "ARA", "unit": "c"}

NO_TOOLS = Case("no_tools", "A plain answer, no calls in it", [], "A plain answer, no calls in it")
SINGLE = Case("single_tool", LYON, [("get_weather", LYON_ARGS)], None, TOOLS)
WITH_CONTENT = Case(
    "single_tool_with_content", "Sure, looking up Lyon now." + LYON, [("get_weather", LYON_ARGS)], "Sure, looking up Lyon now.", TOOLS
)
MULTILINE = Case(
    "single_tool_multiline_param",
    _call("area_of", shape="square", dims='{"side": 7, \n "unit": "m"}', digits="1"),
    [("area_of", {"shape": "square", "dims": {"side": 7, "unit": "m"}, "digits": 1})],
    None,
    TOOLS,
)
TYPED = Case(
    "tool_with_typed_params",
    "Computing the area." + _call("area_of", shape="disc", dims='{"r": 2.25}', digits="4"),
    [("area_of", {"shape": "disc", "dims": {"r": 2.25}, "digits": 4})],
    "Computing the area.",
    TOOLS,
)


def _parallel(unit: str) -> Case:
    text = LYON + "\n" + _call("get_weather", city="Nantes", region="PDL", unit=unit)
    return Case(
        f"parallel_tools_{unit}",
        text,
        [("get_weather", LYON_ARGS), ("get_weather", {"city": "Nantes", "region": "PDL", "unit": unit})],
        None,
        TOOLS,
    )


# The missing </parameter> after the first value: vLLM ends the value where the next parameter begins.
MISSING_CLOSE = Case(
    "missing_closing_parameter_tag",
    "Let me look that up:\n" + LYON.replace("Lyon\n</parameter>", "Lyon"),
    [("get_weather", LYON_ARGS)],
    "Let me look that up:\n",
    TOOLS,
)
NO_OPEN_TAG = Case(
    "missing_opening_tag",
    "Looking it up.\n\n" + LYON.removeprefix("<tool_call>\n"),
    [("get_weather", LYON_ARGS)],
    "Looking it up.\n\n",
    TOOLS,
)
NO_TAGS = Case(
    "fallback_no_tags", LYON.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"), [("get_weather", LYON_ARGS)], None, TOOLS
)
TYPE_CONVERSION = Case(
    "type_conversion",
    _call("typed", an_int="17", a_float="2.5", a_bool="true", a_str="two words", an_obj='{"k": "v"}'),
    [("typed", {"an_int": 17, "a_float": 2.5, "a_bool": True, "a_str": "two words", "an_obj": {"k": "v"}})],
    None,
    TYPED_TOOLS,
)
SINGLE_QUOTES = Case(
    "complex_type_with_single_quote", _call("typed", an_obj="{'k': 'v'}"), [("typed", {"an_obj": {"k": "v"}})], None, TYPED_TOOLS
)
INCREMENTAL = Case(
    "streaming_incremental",
    "Checking." + _call("get_weather", city="Lyon", region="ARA"),
    [("get_weather", {"city": "Lyon", "region": "ARA"})],
    "Checking.",
    TOOLS,
)
# Only whitespace before the call: no content, streamed or whole (vLLM issue 29562).
WHITESPACE_FIRST = Case("no_whitespace_content_before_tool_call", "\n\n" + LYON, [("get_weather", LYON_ARGS)], None, TOOLS)

# vLLM's whole-reply cases (10) and streamed cases (10).
VLLM_WHOLE = [NO_TOOLS, SINGLE, WITH_CONTENT, MULTILINE, _parallel("f"), TYPED, NO_TAGS, TYPE_CONVERSION, MISSING_CLOSE, SINGLE_QUOTES]
VLLM_STREAMED = [
    NO_TOOLS,
    SINGLE,
    WITH_CONTENT,
    MULTILINE,
    _parallel("c"),
    TYPED,
    MISSING_CLOSE,
    INCREMENTAL,
    NO_OPEN_TAG,
    WHITESPACE_FIRST,
]

# Ours: values that do not fit their type, null, a parameter the schema does not name, a nullable type, a tool
# the request does not list, a cut-off last call (vLLM reads it at the reply's end), malformed calls as content.
OURS = [
    Case(
        "lenient_types",
        _call("typed", an_int="seven", a_float="1e400", a_bool="yes", a_str="null", extra="42"),
        [("typed", {"an_int": "seven", "a_float": "1e400", "a_bool": False, "a_str": None, "extra": "42"})],
        None,
        TYPED_TOOLS,
    ),
    Case("nullable_type", _call("t", n="3"), [("t", {"n": 3})], None, [_tool("t", {"n": {"type": ["integer", "null"]}})]),
    Case("unknown_tool_stays_text", _call("other", n="3", o='{"a": 1}'), [("other", {"n": "3", "o": '{"a": 1}'})], None, TOOLS),
    Case(
        "cut_off_last_call",
        "ok" + LYON + "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNice",
        [("get_weather", LYON_ARGS), ("get_weather", {"city": "Nice"})],
        "ok",
        TOOLS,
    ),
    Case(
        "no_close_tags_but_tool_call_end",
        "<tool_call><function=get_weather><parameter=city>Metz</tool_call>",
        [("get_weather", {"city": "Metz"})],
        None,
        TOOLS,
    ),
    Case(
        "unnamed_function_is_content",
        "x<tool_call><function=</function></tool_call>",
        [],
        "x<tool_call><function=</function></tool_call>",
        TOOLS,
    ),
    Case("bad_parameter_tag_is_content", "<function=f><parameter=oops</function>", [], "<function=f><parameter=oops</function>", TOOLS),
    Case("tool_call_tag_only_is_content", "a <tool_call> b", [], "a <tool_call> b", TOOLS),
]


def _parser(case: Case) -> Qwen3CoderToolParser:
    return Qwen3CoderToolParser(tools=case.tools)


@pytest.mark.parametrize("case", VLLM_WHOLE + OURS, ids=lambda c: c.id)
def test_whole(case):
    check_whole(_parser(case).extract(case.text), case)


@pytest.mark.parametrize("case", VLLM_STREAMED + OURS, ids=lambda c: c.id)
def test_streamed(case):
    assert check_streamed(lambda: _parser(case), case) > 1


def test_registry_and_streamed_call_arrives_whole():
    assert get_tool_parser("qwen3_coder") is Qwen3CoderToolParser
    # vLLM streams a call's arguments piece by piece; pagellm's base sends each call once it is complete, so the
    # name and whole arguments arrive together, right after </function>, and nothing before it.
    parser = Qwen3CoderToolParser(tools=TOOLS)
    head, tail = INCREMENTAL.text.split("</function>")
    first = parser.extract_streaming(head, finished=False)
    assert first.content == "Checking." and first.tool_calls == []
    second = parser.extract_streaming("</function>" + tail, finished=False)
    assert [(i, c.name, json.loads(c.arguments)) for i, c in second.tool_calls] == [(0, "get_weather", {"city": "Lyon", "region": "ARA"})]
