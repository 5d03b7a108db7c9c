"""The ``openai`` tool parser: gpt-oss's harmony calls (commentary to ``functions.NAME``) from token ids.

The extraction cases port vLLM's tests/tool_parsers/test_openai_tool_parser.py @ 15c99cb1 as our own data
(no_tools, single_tool x2 argument spellings, multiple_tools, with_content); its structural-tag tests are about
xgrammar request shaping, out of scope here. Each case is also streamed token by token and in larger pieces."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from openai_harmony import Conversation, DeveloperContent, Message, Role, SystemContent

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "reasoning"))
from harmony_fixture import harmony_or_skip

from pagellm.entrypoints.openai.tool_parsers import get_tool_parser


@pytest.fixture
def enc(monkeypatch):
    return harmony_or_skip(monkeypatch)


def user(text):
    return Message.from_role_and_content(Role.USER, text)


def assistant(text, channel, recipient=None, content_type=None):
    msg = Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)
    if recipient:
        msg = msg.with_recipient(recipient)
    return msg.with_content_type(content_type) if content_type else msg


THOUGHT = "The user wants the forecast for Oslo; call get_forecast."
CASES = [
    (
        "no_tools",
        [
            Message.from_role_and_content(Role.SYSTEM, SystemContent.new()),
            Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_instructions("Answer in rhymes.")),
            user("How are you today?"),
            assistant("Doing fine, in rhyme and time", "final"),
        ],
        [],
        "Doing fine, in rhyme and time",
    ),
    (
        "single_tool_compact_args",
        [
            user("Forecast for Oslo?"),
            assistant(THOUGHT, "analysis"),
            assistant('{"city": "Oslo"}', "commentary", "functions.get_forecast", "json"),
        ],
        [("get_forecast", '{"city": "Oslo"}')],
        None,
    ),
    (
        "single_tool_spread_args",
        [
            user("Forecast for Oslo?"),
            assistant(THOUGHT, "analysis"),
            assistant('{\n"city": "Oslo"\n}', "commentary", "functions.get_forecast", "json"),
        ],
        [("get_forecast", '{"city": "Oslo"}')],
        None,
    ),
    (
        "multiple_tools",
        [
            user("Forecast where I am?"),
            assistant("Need the location, then the forecast.", "analysis"),
            assistant('{"city": "Oslo"}', "commentary", "functions.get_forecast", "json"),
            assistant('{"precise": true}', "commentary", "functions.get_location", "json"),
            assistant('{"city": "Oslo"}', "commentary", "functions.untyped_json"),
            assistant("bare words", "commentary", "functions.untyped_text"),
            assistant("{}", "commentary", "functions.empty_object", "json"),
            assistant("", "commentary", "functions.no_arguments", "json"),
        ],
        [
            ("get_forecast", '{"city": "Oslo"}'),
            ("get_location", '{"precise": true}'),
            ("untyped_json", '{"city": "Oslo"}'),
            ("untyped_text", "bare words"),
            ("empty_object", "{}"),
            ("no_arguments", ""),
        ],
        None,
    ),
    (
        "with_content",
        [
            user("Forecast where I am?"),
            assistant("Need the forecast.", "analysis"),
            assistant('{"city": "Oslo"}', "commentary", "functions.get_forecast", "json"),
            assistant("Fetching the forecast for you.", "final"),
        ],
        [("get_forecast", '{"city": "Oslo"}')],
        "Fetching the forecast for you.",
    ),
]


def rendered(enc, messages):
    return enc.render_conversation_for_completion(Conversation.from_messages(messages), Role.ASSISTANT)


@pytest.mark.parametrize("messages, calls, content", [pytest.param(m, c, t, id=i) for i, m, c, t in CASES])
def test_extract(enc, messages, calls, content):
    parser = get_tool_parser("openai")()
    parsed = parser.extract("", rendered(enc, messages))
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == calls
    assert all(c.id.startswith("call") and len(c.id) > 16 for c in parsed.tool_calls)
    assert parsed.content == content
    for c in parsed.tool_calls:
        if c.arguments.startswith("{"):
            json.loads(c.arguments)


@pytest.mark.parametrize("messages, calls, content", [pytest.param(m, c, t, id=i) for i, m, c, t in CASES])
@pytest.mark.parametrize("size", [1, 3, 1000])
def test_streamed(enc, messages, calls, content, size):
    ids = rendered(enc, messages)
    parser = get_tool_parser("openai")()
    got_calls, got_content = [], ""
    pieces = [ids[i : i + size] for i in range(0, len(ids), size)]
    for n, piece in enumerate(pieces):
        d = parser.extract_streaming("", n == len(pieces) - 1, piece)
        got_content += d.content
        got_calls += [(i, c.name, c.arguments) for i, c in d.tool_calls]
    assert got_calls == [(i, name, args) for i, (name, args) in enumerate(calls)]
    assert got_content == (content or "")


def test_partial_reports_complete_calls(enc):
    ids = rendered(enc, CASES[3][1])
    parser = get_tool_parser("openai")()
    assert parser.partial("", ids).content_end == 0
    assert [c.name for c in parser.partial("", ids).calls][:2] == ["get_forecast", "get_location"]


def test_a_prompt_that_opened_the_analysis_channel_is_read_before_the_reply(enc):
    """The reply continues a channel the prompt opened: the tool parser reads it as the reasoning
    parser does, so the call after the thinking is found (and no header leaks into the content)."""
    prompt = enc.encode("<|start|>user<|message|>Weather?<|end|><|start|>assistant<|channel|>analysis<|message|>", allowed_special="all")
    reply = enc.encode(
        'The user wants the weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
        '<|message|>{"city": "Paris"}<|call|>',
        allowed_special="all",
    )
    parser = get_tool_parser("openai")()
    parser.prime(prompt)
    parsed = parser.extract("", reply)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert parsed.content is None
    streamed = get_tool_parser("openai")()
    streamed.prime(prompt)
    calls = []
    for i, token in enumerate(reply):
        calls += [c for _, c in streamed.extract_streaming("", i == len(reply) - 1, [token]).tool_calls]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
