"""The Responses API (``/v1/responses``) on the real server, driven by the official ``openai`` client.

Greedy replies equal the same conversation through ``/v1/chat/completions`` token for token;
streamed events come in OpenAI's order and rebuild the final response; tools, structured output,
``previous_response_id`` chains, the store's bound and every refusal go through the client's
own types and exceptions.
"""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai_server_utils import API_KEY, RemoteServer
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_STORED = 4
QUESTION = "What is the capital of France? Answer in one sentence."
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER_PARAMS}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}


@pytest.fixture(scope="module")
def server():
    args = ["--max-model-len", "1024", "--kv-cache-memory", "64MiB", "--api-key", API_KEY, "--disable-uvicorn-access-log",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--max-stored-responses", str(MAX_STORED)]
    srv = RemoteServer(args)
    yield srv
    srv.terminate()
    srv.cleanup()


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client(timeout=300)


def chat_text(client, messages, max_tokens: int, **kwargs):
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kwargs)
    return resp.choices[0], resp.usage


def test_text_with_instructions_equals_chat(client):
    resp = client.responses.create(
        model=MODEL, input=QUESTION, instructions="You are a geography teacher.", max_output_tokens=32, temperature=0,
        metadata={"k": "v"}, user="u-1",
    )
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.created_at > 0
    assert resp.status == "completed" and resp.incomplete_details is None and resp.error is None
    (message,) = resp.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.id.startswith("msg_") and message.content[0].type == "output_text"
    assert "Paris" in resp.output_text
    assert (resp.instructions, resp.max_output_tokens, resp.temperature, resp.metadata, resp.user) == (
        "You are a geography teacher.", 32, 0.0, {"k": "v"}, "u-1"
    )
    assert resp.store is True and resp.parallel_tool_calls is True and resp.tools == []
    usage = resp.usage
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0 and usage.output_tokens_details.reasoning_tokens == 0
    choice, chat_usage = chat_text(client, [{"role": "system", "content": "You are a geography teacher."},
                                            {"role": "user", "content": QUESTION}], 32)
    assert resp.output_text == choice.message.content
    assert (usage.input_tokens, usage.output_tokens) == (chat_usage.prompt_tokens, chat_usage.completion_tokens)


def test_items_input_equals_chat(client):
    items = [
        {"type": "message", "role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
        {"role": "user", "content": "Name another one."},
    ]
    resp = client.responses.create(model=MODEL, input=items, max_output_tokens=24, temperature=0)
    messages = [{"role": "developer", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Name another one."}]
    choice, chat_usage = chat_text(client, messages, 24)
    assert resp.output_text == choice.message.content
    assert (resp.usage.input_tokens, resp.usage.output_tokens) == (chat_usage.prompt_tokens, chat_usage.completion_tokens)


def test_max_output_tokens_makes_it_incomplete(client):
    resp = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=4, temperature=0)
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.output[0].status == "incomplete" and resp.usage.output_tokens == 4 and resp.output_text


def test_stream_events_in_order_and_final_response(client):
    kwargs = dict(model=MODEL, input=QUESTION, max_output_tokens=32, temperature=0)
    full = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    num_deltas = kinds.count("response.output_text.delta")
    assert num_deltas >= 2
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"] + [
        "response.output_text.delta"] * num_deltas + ["response.output_text.done", "response.content_part.done",
                                                       "response.output_item.done", "response.completed"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert all(e.response.id == final.id for e in events if hasattr(e, "response"))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == full.output_text
    assert next(e for e in events if e.type == "response.output_text.done").text == text
    assert final.usage.output_tokens == full.usage.output_tokens and final.status == "completed"
    assert client.responses.retrieve(final.id).output_text == text  # streamed responses are stored too


def test_stream_that_hits_the_cap_ends_incomplete(client):
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=3, temperature=0) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens" and events[-1].response.usage.output_tokens == 3


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


def test_parse_with_a_pydantic_text_format(client):
    resp = client.responses.parse(model=MODEL, input="Name one big city and its country.", text_format=City, max_output_tokens=64,
                                  temperature=0)
    assert resp.status == "completed"
    assert isinstance(resp.output_parsed, City) and resp.output_parsed.name
    assert resp.text.format.type == "json_schema" and resp.text.format.name == "City"


def test_function_call_then_its_output_via_previous_response_id(client):
    first = client.responses.create(model=MODEL, input="What is the weather like in Paris today?", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=64, temperature=0)
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)
    assert first.tools[0].name == "get_weather" and first.tool_choice.name == "get_weather"
    output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21, "sky": "clear"}'}
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input=[output], tools=[WEATHER], tool_choice="auto",
                                     max_output_tokens=16, temperature=0)
    assert second.previous_response_id == first.id and second.usage.input_tokens > first.usage.input_tokens
    # The same turn spelt out on /v1/chat/completions gives the same reply.
    messages = [
        {"role": "user", "content": "What is the weather like in Paris today?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        ]},
        {"role": "tool", "tool_call_id": call.call_id, "content": output["output"]},
    ]
    choice, chat_usage = chat_text(client, messages, 16, tools=[CHAT_WEATHER], tool_choice="auto")
    assert second.usage.input_tokens == chat_usage.prompt_tokens
    got = [(i.type, i.content[0].text if i.type == "message" else (i.name, i.arguments)) for i in second.output]
    want = ([("message", choice.message.content)] if choice.message.content is not None else []) + [
        ("function_call", (c.function.name, c.function.arguments)) for c in choice.message.tool_calls or []
    ]
    assert got == want


def test_streamed_function_call_events(client):
    with client.responses.stream(model=MODEL, input="Weather in Rome?", tools=[WEATHER], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=64, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[2:] == ["response.output_item.added", "response.function_call_arguments.delta",
                         "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    (call,) = final.output
    assert call.type == "function_call" and events[2].item.call_id == call.call_id and events[4].arguments == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMS)


def test_retrieve_delete_and_store_false(client):
    resp = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=4, temperature=0)
    assert client.responses.retrieve(resp.id).model_dump() == resp.model_dump()
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(resp.id)
    unstored = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=4, temperature=0, store=False)
    assert unstored.store is False and unstored.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError, match="not found"):
        client.responses.create(model=MODEL, input="And?", previous_response_id=unstored.id, max_output_tokens=4)


def test_the_store_keeps_the_newest(client):
    ids = [client.responses.create(model=MODEL, input=f"Count to {i}.", max_output_tokens=1).id for i in range(MAX_STORED + 1)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"tools": [{"type": "web_search_preview"}]}, "built-in tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "images"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
        ({"input": [{"role": "tool", "content": "x"}]}, "role"),
        ({"background": True}, "background"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "not among the tools"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "schema"),
        ({"input": []}, "empty"),
    ],
)
def test_unsupported_or_bad_input_is_400(server, extra, match):
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 4, **extra}
    resp = httpx.post(f"{server.url}/v1/responses", json=body, headers=AUTH, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and match in err["message"], err


def test_unknown_ids_are_404_and_the_key_is_required(server, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="hi", previous_response_id="resp_missing", max_output_tokens=4)
    assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_missing")
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="hi", max_output_tokens=4)
    resp = client.responses.create(model=MODEL, input="hi", max_output_tokens=2)
    intruder = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    for call in (lambda: intruder.responses.create(model=MODEL, input="hi", max_output_tokens=2),
                 lambda: intruder.responses.retrieve(resp.id), lambda: intruder.responses.delete(resp.id)):
        with pytest.raises(openai.AuthenticationError):
            call()
    assert client.responses.retrieve(resp.id).id == resp.id
