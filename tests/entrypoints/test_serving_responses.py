"""The Responses API in-process on the model-free engine: shapes against the openai package's types,
the prompt each turn renders, the store, input items and the output builder."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fake_engine import FakeEngine
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.errors import APIError
from pagellm.entrypoints.metrics import EngineMetrics
from pagellm.entrypoints.openai.api_server import build_app
from pagellm.entrypoints.openai.input_items import items_to_messages, normalize_input
from pagellm.entrypoints.openai.protocol import DeltaFunctionCall, DeltaMessage, DeltaToolCall
from pagellm.entrypoints.openai.protocol_responses import ResponseObject
from pagellm.entrypoints.openai.response_store import ResponseStore
from pagellm.entrypoints.openai.serving_chat import ChatDelta
from pagellm.entrypoints.openai.serving_responses import ResponseBuilder

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
EVENTS = TypeAdapter(ResponseStreamEvent)


class RecordingEngine(FakeEngine):
    """Keeps each request's prompt text and sampling parameters."""

    def __init__(self) -> None:
        super().__init__(max_model_len=256)
        self.tokenizer.chat_template = "toy"  # any template: FakeTokenizer renders "<role>content"
        self.seen: list[tuple[str, object]] = []

    def add_request(self, request_id, prompt, params, output_kind, arrival_time=None, processed=None, lora_request=None):
        processed = processed or self.process_prompt(prompt, params)
        self.seen.append((processed.prompt, params))
        super().add_request(request_id, prompt, params, output_kind, arrival_time, processed, lora_request)


@pytest.fixture
def app():
    engine = RecordingEngine()
    metrics = EngineMetrics(engine.model_name)
    llm = AsyncLLM(engine, stat_logger=metrics)
    application = build_app(llm, metrics, api_key=API_KEY, dashboard=False, max_stored_responses=2)
    application.state.engine = engine
    yield application
    llm.shutdown()


def call(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.request(method, path, headers=AUTH, **kwargs)

    return asyncio.run(go())


def sse_events(text: str) -> list[dict]:
    events = []
    for block in text.strip().split("\n\n"):
        kind, data = block.split("\n")
        body = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {body['type']}"
        events.append(body)
    return events


def test_response_parses_as_openai_types_and_turns_chain(app):
    first = call(app, "POST", "/v1/responses", json={"input": "hi", "instructions": "sys", "max_output_tokens": 3})
    assert first.status_code == 200, first.text
    parsed = Response.model_validate(first.json())
    assert parsed.status == "incomplete" and parsed.incomplete_details.reason == "max_output_tokens"
    assert parsed.output_text == "t0 t1 t2 " and parsed.usage.output_tokens == 3
    second = call(app, "POST", "/v1/responses", json={"input": "again", "max_output_tokens": 2, "previous_response_id": parsed.id})
    assert second.status_code == 200, second.text
    prompts = [prompt for prompt, _ in app.state.engine.seen]
    # The previous turn's input and output are carried, its instructions are not.
    assert prompts == ["<system>sys<user>hi<assistant>", "<user>hi<assistant>t0 t1 t2 <user>again<assistant>"]
    assert call(app, "GET", f"/v1/responses/{parsed.id}").json() == first.json()
    assert call(app, "DELETE", f"/v1/responses/{parsed.id}").json() == {"id": parsed.id, "object": "response.deleted", "deleted": True}
    assert call(app, "GET", f"/v1/responses/{parsed.id}").status_code == 404


def test_stream_events_validate_and_match_the_final_response(app):
    resp = call(app, "POST", "/v1/responses", json={"input": "hi", "max_output_tokens": 3, "stream": True})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    typed = [EVENTS.validate_python(e) for e in events]
    assert [e.sequence_number for e in typed] == list(range(len(typed)))
    assert typed[-1].type == "response.incomplete"
    final = typed[-1].response
    assert "".join(e.delta for e in typed if e.type == "response.output_text.delta") == final.output_text == "t0 t1 t2 "
    assert call(app, "GET", f"/v1/responses/{final.id}").json() == events[-1]["response"]


def test_text_format_reaches_the_structured_output_path(app):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    resp = call(app, "POST", "/v1/responses", json={"input": "x", "max_output_tokens": 2, "text": {"format": fmt}})
    assert resp.json()["text"] == {"format": fmt}
    call(app, "POST", "/v1/responses", json={"input": "x", "max_output_tokens": 2, "text": {"format": {"type": "json_object"}}})
    (_, with_schema), (_, with_object) = app.state.engine.seen
    assert with_schema.structured_outputs.json == schema and with_object.structured_outputs.json_object


def test_store_false_the_bound_and_the_key(app):
    ids = [call(app, "POST", "/v1/responses", json={"input": "x", "max_output_tokens": 1}).json()["id"] for _ in range(3)]
    assert [call(app, "GET", f"/v1/responses/{i}").status_code for i in ids] == [404, 200, 200]
    unstored = call(app, "POST", "/v1/responses", json={"input": "x", "max_output_tokens": 1, "store": False}).json()
    assert unstored["store"] is False and call(app, "GET", f"/v1/responses/{unstored['id']}").status_code == 404
    missing = call(app, "POST", "/v1/responses", json={"input": "x", "previous_response_id": "resp_nope"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "previous_response_id"

    async def no_key():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.post("/v1/responses", json={"input": "x"})

    assert asyncio.run(no_key()).status_code == 401


def test_store_is_lru_and_bounded():
    store = ResponseStore(2)
    a, b, c = (ResponseObject(model="m") for _ in range(3))
    store.put(a, [])
    store.put(b, [])
    store.get(a.id)  # a is now the newest
    store.put(c, [])
    assert len(store) == 2 and store.get(a.id).response is a
    with pytest.raises(APIError, match="not found"):
        store.get(b.id)
    empty = ResponseStore(0)
    empty.put(a, [])
    assert len(empty) == 0
    with pytest.raises(ValueError):
        ResponseStore(-1)


def test_items_become_chat_messages():
    items = normalize_input([
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "calling"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
    ])
    messages = [m.model_dump(exclude_none=True) for m in items_to_messages(items, "be brief")]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool"]
    assert messages[1]["content"] == "a\nb" and messages[2]["content"] == "calling"
    assert [c["id"] for c in messages[2]["tool_calls"]] == ["c1", "c2"] and messages[3]["tool_call_id"] == "c1"
    with pytest.raises(APIError, match=r"input\[0\].*images"):
        normalize_input([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}])
    with pytest.raises(APIError, match="call_id"):
        normalize_input([{"type": "function_call_output", "output": "1"}])


def _call_deltas(call_id: str, name: str, arguments: str) -> list[ChatDelta]:
    first = DeltaToolCall(index=0, id=call_id, type="function", function=DeltaFunctionCall(name=name, arguments=""))
    rest = DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=arguments))
    return [ChatDelta(0, DeltaMessage(tool_calls=[first])), ChatDelta(0, DeltaMessage(tool_calls=[rest]))]


def test_builder_drops_leading_whitespace_and_extra_calls_when_not_parallel():
    builder = ResponseBuilder(ResponseObject(model="m", parallel_tool_calls=False), emit=True)
    events = builder.feed(ChatDelta(0, DeltaMessage(content="\n")))
    for d in _call_deltas("c1", "f", '{"x": 1}') + _call_deltas("c2", "g", "{}"):
        events += builder.feed(d)
    events += builder.feed(ChatDelta(0, DeltaMessage(), finish_reason="tool_calls"))
    events += builder.finish()
    response = Response.model_validate(builder.response.model_dump())
    assert [(i.type, i.call_id, i.arguments) for i in response.output] == [("function_call", "c1", '{"x": 1}')]
    kinds = [sse_events(e)[0]["type"] for e in events]
    assert kinds == ["response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
