"""The ``pythonic`` tool-call parser, whole and streamed.

Cases ported from vLLM's tests/tool_parsers/test_pythonic_tool_parser.py (the model outputs and
calls written out here as data). Each whole case is also streamed in pieces of every size and in
token-like pieces, which must give the same content and calls.
"""
from __future__ import annotations

import json

import pytest
from _utils_yours_b import names_args, stream, whole_and_streamed

from pagellm.entrypoints.openai.tool_parsers import get_tool_parser
from pagellm.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser

SIMPLE = ("get_weather(city='San Francisco', metric='celsius')", "get_weather", '{"city": "San Francisco", "metric": "celsius"}')
MORE_TYPES = (
    "register_user(name='John Doe', age=37, address={'city': 'San Francisco', 'state': 'CA'}, role=None, passed_test=True, "
    "aliases=['John', 'Johnny'])",
    "register_user",
    '{"name": "John Doe", "age": 37, "address": {"city": "San Francisco", "state": "CA"}, "role": null, "passed_test": true, '
    '"aliases": ["John", "Johnny"]}',
)
PARAMETERLESS = ("get_weather()", "get_weather", "{}")
EMPTY_DICT = ("do_something_cool(additional_data={})", "do_something_cool", '{"additional_data": {}}')
EMPTY_LIST = ("do_something_cool(steps=[])", "do_something_cool", '{"steps": []}')
ESCAPED = (r"""get_weather(city='Martha\'s Vineyard', metric='\"cool units\"')""", "get_weather",
           '{"city": "Martha\'s Vineyard", "metric": "\\"cool units\\""}')

# vLLM's test_tool_call cases (each run there streamed and not): [calls] -> the calls.
CALL_CASES = {
    "simple": [SIMPLE],
    "more_types": [MORE_TYPES],
    "parameterless": [PARAMETERLESS],
    "empty_dict": [EMPTY_DICT],
    "empty_list": [EMPTY_LIST],
    "escaped_string": [ESCAPED],
    "parallel_calls": [SIMPLE, MORE_TYPES],
}


@pytest.mark.parametrize("case", CALL_CASES)
def test_tool_call(case):
    calls = CALL_CASES[case]
    text = "[" + ", ".join(src for src, _, _ in calls) + "]"
    whole = whole_and_streamed(PythonicToolParser, text)
    assert whole.content is None
    # vLLM compares the arguments text itself, not only the JSON it holds.
    assert [(c.name, c.arguments) for c in whole.tool_calls] == [(name, args) for _, name, args in calls]


def test_no_tool_call():
    text = "How can I help you today?"
    whole = whole_and_streamed(PythonicToolParser, text)
    assert whole.content == text and whole.tool_calls == []


def test_streaming_tool_call_with_large_steps():
    pieces = ["[get_weather(city='San", f" Francisco', metric='celsius'), {PARAMETERLESS[0]}, {EMPTY_LIST[0]}]"]
    got = stream(PythonicToolParser, pieces)
    assert got.content == ""
    assert got.calls == [(SIMPLE[1], SIMPLE[2]), (PARAMETERLESS[1], PARAMETERLESS[2]), (EMPTY_LIST[1], EMPTY_LIST[2])]


def test_call_like_text_that_is_not_a_list_is_content():
    # vLLM's regex-timeout case: its input must come back as text (vLLM: when the regex gives up).
    text = "hello world[A(A=" + "\t)A(A=,\t" * 2
    whole = whole_and_streamed(PythonicToolParser, text)
    assert whole.content == text and whole.tool_calls == []


# Cases from vLLM's later test file where a bad call leaves the whole reply content. In vLLM's
# later parser a good sibling call survives instead; pagellm keeps one rule for every parser: a
# reply with a call that does not parse is content (base.ToolParser.extract).
ALL_CONTENT = {
    "unrecoverable_block": "[f(a='x 'y' 'z), g(b='p 'q' 'r)]",
    "mismatched_brackets": "[foo(x=1])]",
    "bytes_argument_sibling": f"[bad(x=b'z'), {SIMPLE[0]}]",
    "non_finite_argument": f"[calc(x=1e999), {SIMPLE[0]}]",
    "unparsable_sibling": f"[{SIMPLE[0]}, f(a='x 'y', b='z')]",
}


@pytest.mark.parametrize("case", ALL_CONTENT)
def test_bad_call_leaves_the_reply_content(case):
    text = ALL_CONTENT[case]
    whole = PythonicToolParser().extract(text)
    assert whole.content == text and whole.tool_calls == []
    if case in ("unrecoverable_block", "mismatched_brackets", "bytes_argument_sibling", "non_finite_argument"):
        # The bad call comes first, so no stream sends a call before the reply turns out content.
        whole_and_streamed(PythonicToolParser, text)
    else:
        got = stream(PythonicToolParser, [text[: len(SIMPLE[0]) + 3], text[len(SIMPLE[0]) + 3 :]])
        assert got.content == text and got.calls == [(SIMPLE[1], SIMPLE[2])]  # the good call went out first


# pagellm's own cases: what is and is not a call.
OWN = {
    "negative_and_float": ("[f(x=-1, y=+2.5, z=[-3])]", [("f", {"x": -1, "y": 2.5, "z": [-3]})]),
    "nested_values": ("[f(a={'k': [1, {'n': None}], 2: False})]", [("f", {"a": {"k": [1, {"n": None}], "2": False}})]),
    "trailing_comma_and_newlines": ("[f(a=1),\n g(b='x'),\n]\n", [("f", {"a": 1}), ("g", {"b": "x"})]),
    "unicode": ("[say(text='héllo ☃')]", [("say", {"text": "héllo ☃"})]),
    "brackets_in_strings": ("[f(s='a)], [(b', t=\"}{\")]", [("f", {"s": "a)], [(b", "t": "}{"})]),
}
NOT_CALLS = [
    "[]", "[1, 2]", "[f(1)]", "[f(**kw)]", "[f(a=x)]", "[f(a=1+2)]", "[obj.f(a=1)]", "[f(a=(1, 2))]", "[f(a={x: 1})]",
    " [f(a=1)]", "[f(a=1)] and then text", "Sure: [f(a=1)]", "[Note] this is prose", "[f(a=1)",
]


@pytest.mark.parametrize("case", OWN)
def test_own_calls(case):
    text, expected = OWN[case]
    whole = whole_and_streamed(PythonicToolParser, text)
    assert whole.content is None and names_args(whole) == expected


@pytest.mark.parametrize("text", NOT_CALLS)
def test_own_not_calls(text):
    whole = whole_and_streamed(PythonicToolParser, text)
    assert whole.content == text and whole.tool_calls == []


def test_prose_in_brackets_is_sent_before_the_reply_ends():
    parser = PythonicToolParser()
    assert parser.extract_streaming("[Note] this", False).content == "[Note] this"
    parser = PythonicToolParser()
    assert parser.extract_streaming("[get_wea", False).content == ""


def test_registry_and_json_arguments():
    assert get_tool_parser("pythonic") is PythonicToolParser
    whole = PythonicToolParser().extract("[f(q='a \"quoted\" \\\\ path')]")
    assert json.loads(whole.tool_calls[0].arguments) == {"q": 'a "quoted" \\ path'}


def test_a_call_goes_out_once_the_next_one_begins():
    parser = PythonicToolParser()
    delta = parser.extract_streaming(f"[{SIMPLE[0]}, {MORE_TYPES[0][:20]}", False)
    assert delta.content == "" and [(i, c.name, c.arguments) for i, c in delta.tool_calls] == [(0, SIMPLE[1], SIMPLE[2])]
    delta = parser.extract_streaming(MORE_TYPES[0][20:] + "]", True)
    assert [(i, c.name) for i, c in delta.tool_calls] == [(1, MORE_TYPES[1])]
