"""Tool calling through the real server (``--enable-auto-tool-choice --tool-call-parser hermes``).

Forced calls (``required``, a named function) always parse and match the tool's parameters;
``auto`` replies are read by the hermes parser (the model is steered into that format with a
regex here, as a 135M model rarely calls tools by itself); streamed calls reassemble to the
non-streamed ones.
"""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai_server_utils import API_KEY, RemoteServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"timezone": {"type": "string", "maxLength": 12}},
            "required": ["timezone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris today?"}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server():
    args = ["--max-model-len", "1024", "--kv-cache-memory", "64MiB", "--api-key", API_KEY, "--disable-uvicorn-access-log",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    srv = RemoteServer(args)
    yield srv
    srv.terminate()
    srv.cleanup()


def reassemble(stream) -> tuple[str, list[dict], str]:
    content, calls, finish = "", {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            if tc.id:
                call["id"] = tc.id
            if tc.function and tc.function.name:
                call["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                call["arguments"] += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def both(client, **kwargs):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=100, temperature=0, **kwargs)
    streamed = reassemble(
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=100, temperature=0, stream=True, **kwargs)
    )
    return full.choices[0], streamed


def check_same(choice, streamed) -> None:
    content, calls, finish = streamed
    assert finish == choice.finish_reason
    assert (content.strip() or None) == (choice.message.content.strip() if choice.message.content else None)
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert all(c["id"] and c["id"].startswith("call") for c in calls)


def test_named_function_is_forced(server):
    client = server.openai_client(timeout=300)
    choice, streamed = both(client, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert choice.message.content is None and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS["get_weather"])
    check_same(choice, streamed)


def test_required_always_calls(server):
    client = server.openai_client(timeout=300)
    # One call: with parallel calls allowed, this small model keeps adding calls to the array.
    choice, streamed = both(client, tool_choice="required", parallel_tool_calls=False)
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    check_same(choice, streamed)


def test_auto_parses_the_models_tool_call_format(server):
    client = server.openai_client(timeout=300)
    regex = r'Sure\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,9}", "unit": "celsius"\}\}\n</tool_call>'
    choice, streamed = both(client, tool_choice="auto", extra_body={"guided_regex": regex})
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure.\n"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] == "celsius"
    check_same(choice, streamed)
    # Without steering, whatever the model writes comes back whole, as content or calls.
    choice, streamed = both(client)
    check_same(choice, streamed)


def test_none_and_history_with_tool_messages(server):
    client = server.openai_client(timeout=300)
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0)
    assert resp.choices[0].message.tool_calls in (None, []) and resp.choices[0].message.content
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call-1", "content": '{"temperature": 21}'},
    ]
    resp = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0)
    assert resp.choices[0].message.content


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required", "guided_regex": "a"}, "cannot be combined"),
        ({"tools": None, "tool_choice": "required"}, "needs tools"),
    ],
)
def test_bad_tool_requests_are_400(server, extra, match):
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 4, **extra}
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert resp.status_code == 400 and match in resp.json()["error"]["message"], resp.text
