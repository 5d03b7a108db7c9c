"""The llama3_json tool-call parser, whole and streamed: vLLM's cases (tests/tool_parsers/test_llama3_json_tool_parser.py)
rewritten as data, and a few of ours. vLLM's file checks whole replies only; each case here is streamed too."""

from __future__ import annotations

import json

import pytest
from _utils_yours_a import Case, check_streamed, check_whole

from pagellm.entrypoints.openai.tool_parsers import get_tool_parser
from pagellm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

SEARCH_1 = '{"name": "search", "parameters": {"query": "red shoes"}}'
TICKETS = '{"name": "listOpenTickets", "parameters": {}}'
SEARCH_2 = '{"name": "search", "parameters": {"query": "blue hats"}}'
THREE_CALLS = [("search", {"query": "red shoes"}), ("listOpenTickets", {}), ("search", {"query": "blue hats"})]

# vLLM's 15 cases. Where vLLM drops the text before the calls (content None), pagellm keeps it as content, as its
# other parsers and the streamed reply do: "simple" and "multiple_json_with_surrounding_text" differ there.
VLLM = [
    Case("simple", f"Here is the result: {TICKETS} Anything else?", [("listOpenTickets", {})], "Here is the result: "),
    Case(
        "with_arguments",
        '{"name": "search", "parameters": {"query": "red shoes", "limit": 5}}',
        [("search", {"query": "red shoes", "limit": 5})],
        None,
    ),
    Case("no_json", "Just words, nothing to call", [], "Just words, nothing to call"),
    Case("invalid_json", '{"name": "broken", "parameters": {not json}', [], '{"name": "broken", "parameters": {not json}'),
    Case("with_arguments_key", '{"name": "search", "arguments": {"query": "hats"}}', [("search", {"query": "hats"})], None),
    Case("multiple_json", f"{SEARCH_1}; {TICKETS}; {SEARCH_2}", THREE_CALLS, None),
    Case("multiple_json_with_whitespace", f"{SEARCH_1} ; {TICKETS} ; {SEARCH_2}", THREE_CALLS, None),
    Case("multiple_json_with_surrounding_text", f"Found these: {SEARCH_1}; {TICKETS}; {SEARCH_2} Want more?", THREE_CALLS, "Found these: "),
    Case(
        "deeply_nested_json",
        '{"name": "deep", "parameters": {"a": {"b": {"c": {"d": {"leaf": "bottom"}}}}}}',
        [("deep", {"a": {"b": {"c": {"d": {"leaf": "bottom"}}}}})],
        None,
    ),
    Case(
        "multiple_with_deep_nesting",
        '{"name": "flat", "parameters": {"v": "x"}}; {"name": "deep", "parameters": {"cfg": {"db": {"pool": {"max": {"n": 8}}}}}}',
        [("flat", {"v": "x"}), ("deep", {"cfg": {"db": {"pool": {"max": {"n": 8}}}}})],
        None,
    ),
    Case(
        "quotes_and_brackets_in_string",
        '{"name": "search", "parameters": {"query": "a {b} [c]","inner": {"s": "more {braces}"}}}',
        [("search", {"query": "a {b} [c]", "inner": {"s": "more {braces}"}})],
        None,
    ),
    Case(
        "escaped_quotes_in_nested_json",
        r'{"name": "say", "parameters": {"text": "She said \"hi {there}\""}}',
        [("say", {"text": 'She said "hi {there}"'})],
        None,
    ),
    Case("missing_name_key", '{"parameters": {}}', [], '{"parameters": {}}'),
    Case("missing_parameters_and_arguments_key", '{"name": "noArgs"}', [], '{"name": "noArgs"}'),
    # vLLM feeds this through a regex mocked to time out; the parser here has no regex, the reply is content all the same.
    Case("regex_timeout_input", "{hello world[A(A=" + "\t)A(A=,\t" * 2, [], "{hello world[A(A=" + "\t)A(A=,\t" * 2),
]

OURS = [
    Case("python_tag", "<|python_tag|>" + SEARCH_1, [("search", {"query": "red shoes"})], None),
    Case("python_tag_after_text", "Searching.\n<|python_tag|>" + SEARCH_1, [("search", {"query": "red shoes"})], "Searching.\n"),
    Case("python_tag_without_json", "Hi <|python_tag|> there", [], "Hi <|python_tag|> there"),
    Case("arguments_over_parameters", '{"name": "f", "arguments": {"a": 1}, "parameters": {"b": 2}}', [("f", {"a": 1})], None),
    Case("arguments_as_json_text", '{"name": "f", "arguments": "{\\"a\\": 1}"}', [("f", {"a": 1})], None),
    Case("arguments_not_an_object", '{"name": "f", "arguments": [1, 2]}', [], '{"name": "f", "arguments": [1, 2]}'),
    Case("unclosed_call_is_content", 'Ok {"name": "f", "parameters": {"a": 1}', [], 'Ok {"name": "f", "parameters": {"a": 1}'),
    Case("whitespace_before_call", "\n " + TICKETS, [("listOpenTickets", {})], None),
    Case("unicode_kept", '{"name": "say", "parameters": {"text": "héllo ✓"}}', [("say", {"text": "héllo ✓"})], None),
]

# As in vLLM, a brace after the calls that starts no call makes the whole reply content. Streamed, the calls before
# it have already gone out (the base sends each call once complete), so this one is checked whole, and below.
BRACE_AFTER_CALL = Case("brace_in_prose_after_a_call", f"{TICKETS} then use {{x}}", [], f"{TICKETS} then use {{x}}")


@pytest.mark.parametrize("case", VLLM + OURS + [BRACE_AFTER_CALL], ids=lambda c: c.id)
def test_whole(case):
    check_whole(Llama3JsonToolParser().extract(case.text), case)


@pytest.mark.parametrize("case", VLLM + OURS, ids=lambda c: c.id)
def test_streamed(case):
    assert check_streamed(Llama3JsonToolParser, case) > 1


def test_arguments_text_and_registry():
    assert get_tool_parser("llama3_json") is Llama3JsonToolParser
    parsed = Llama3JsonToolParser().extract(f"{TICKETS}; " + '{"name": "say", "parameters": {"text": "héllo"}}')
    # vLLM's exact argument text: "{}" for no arguments, non-ASCII kept as written.
    assert [c.arguments for c in parsed.tool_calls] == ["{}", '{"text": "héllo"}']
    assert json.loads(parsed.tool_calls[1].arguments) == {"text": "héllo"}


def test_prose_with_a_brace_streams_on_once_it_cannot_be_a_call():
    parser = Llama3JsonToolParser()
    assert parser.extract_streaming("Use {x", finished=False).content == "Use "  # may still become a call: held
    assert parser.extract_streaming("} here and", finished=False).content == "{x} here and"  # {x} is no call: all content
    assert parser.extract_streaming(" more", finished=True).content == " more"


def test_streamed_call_stays_sent_when_a_later_brace_makes_the_reply_content():
    parser = Llama3JsonToolParser()
    first = parser.extract_streaming(TICKETS + " then use", finished=False)
    last = parser.extract_streaming(" {x}", finished=True)
    assert [c.name for _, c in first.tool_calls] == ["listOpenTickets"] and not last.tool_calls
    assert first.content + last.content == BRACE_AFTER_CALL.text  # nothing lost: the rest comes as content
