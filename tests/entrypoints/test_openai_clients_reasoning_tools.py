"""LangChain's ``ChatOpenAI`` and the OpenAI Agents SDK against a pagellm server started with
``--reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser qwen3_coder``.

The model is a tiny random checkpoint, made to answer deterministically with the engine's own
features, passed through each library's extra-body mechanism: ``thinking_token_budget`` ends the
thinking (``</think>``) after a few sampled tokens (seeded, so they are the same on every run), and a
``structured_outputs`` regex constrains only what follows the thinking, spelling exactly one
qwen3_coder tool call on the first turn and the final answer once the tool has answered.

What each library exposes of the thinking:
- ``ChatOpenAI`` on Chat Completions drops ``reasoning``/``reasoning_content`` (langchain-openai 1.x
  reads only the official OpenAI fields); it keeps the reasoning token count in ``usage_metadata``.
  The raw body it was given carries the thinking, read here through an httpx hook on its client.
- ``ChatOpenAI(use_responses_api=True)`` keeps the Responses API's reasoning item as a content block.
- The Agents SDK's Chat Completions model turns ``reasoning_content`` into a ``ReasoningItem`` (its
  summary); its Responses model keeps the reasoning item (its ``reasoning_text`` content).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any, Literal

import httpx
import pytest
from openai_server_utils import API_KEY, SERVER_ARGS, RemoteServer, thinking_llama_args

pytestmark = pytest.mark.slow

BUDGET = 4
QUESTION = "What is the weather in Paris?"
CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
WEATHER = "Sunny, 22 C"
ANSWER = "It is sunny in Paris, 22 C."
MAX_TOKENS = 128  # the thinking, its end marker and the call: 55 to 70 tokens as sampled, ~105 at most


def literal_regex(text: str) -> str:
    """A regex (xgrammar's dialect) that matches exactly ``text``."""
    return "".join("\\n" if ch == "\n" else "\\" + ch if ch in ".^$*+?{}[]\\|()" else ch for ch in text)


def constrained(text: str) -> dict[str, Any]:
    """The request body's extras that make the reply ``BUDGET`` seeded thinking tokens, then ``text``."""
    return {"seed": 0, "thinking_token_budget": BUDGET, "structured_outputs": {"regex": literal_regex(text)}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = thinking_llama_args(tmp_path_factory.mktemp("thinking-tools-llama"))
    srv = RemoteServer([*args, "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder", *SERVER_ARGS])
    yield srv
    srv.stop_and_check()


@pytest.fixture(scope="module")
def model_name(server) -> str:
    return server.openai_client().models.list().data[0].id


# ---------------------------------------------------------------- LangChain


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return WEATHER


def get_paris_weather(city: Literal["Paris"]) -> str:
    """The current weather in a city (only Paris: a forced call's JSON then has one value)."""
    return WEATHER


def _chat_openai(server, model_name: str, temperature: float = 1.0, **kwargs):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=model_name, base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, temperature=temperature, **kwargs)


class BodyRecorder:
    """An httpx response hook keeping the JSON bodies of non-streamed replies (what the library was given)."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def __call__(self, response: httpx.Response) -> None:
        if response.headers.get("content-type", "").startswith("application/json"):
            response.read()
            self.bodies.append(response.json())


@pytest.fixture(scope="module")
def langchain_first_turn(server, model_name):
    from langchain_core.messages import HumanMessage

    recorder = BodyRecorder()
    with httpx.Client(event_hooks={"response": [recorder]}) as http_client:
        llm = _chat_openai(server, model_name, max_tokens=MAX_TOKENS, extra_body=constrained(CALL), http_client=http_client)
        prompt = [HumanMessage(QUESTION)]
        message = llm.bind_tools([get_weather]).invoke(prompt)
    return prompt, message, recorder.bodies[-1]


def test_langchain_invoke_reads_the_tool_call(langchain_first_turn):
    _, message, _ = langchain_first_turn
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and call["args"] == {"city": "Paris"} and call["id"]
    assert not message.invalid_tool_calls
    assert message.content == ""  # the call's markup is not left in the text
    assert message.response_metadata["finish_reason"] == "tool_calls"


def test_langchain_chat_completions_keeps_only_the_reasoning_token_count(langchain_first_turn):
    _, message, raw = langchain_first_turn
    # langchain-openai 1.x drops the non-standard reasoning fields from the AIMessage (its documented
    # "API scope"); the count survives in the usage, and the body it read has the thinking itself.
    assert message.usage_metadata["output_token_details"]["reasoning"] == BUDGET
    raw_message = raw["choices"][0]["message"]
    assert raw_message["reasoning"].strip() and raw_message["reasoning"] == raw_message["reasoning_content"]
    assert raw_message["tool_calls"][0]["id"] == message.tool_calls[0]["id"]
    assert raw["usage"]["completion_tokens_details"]["reasoning_tokens"] == BUDGET


def test_langchain_stream_gives_chunks_that_join_into_the_call(server, model_name, langchain_first_turn):
    prompt, whole, _ = langchain_first_turn
    llm = _chat_openai(server, model_name, max_tokens=MAX_TOKENS, extra_body=constrained(CALL))
    chunks = list(llm.bind_tools([get_weather]).stream(prompt))
    assert any(chunk.tool_call_chunks for chunk in chunks)
    joined = chunks[0]
    for chunk in chunks[1:]:
        joined = joined + chunk
    (call,) = joined.tool_calls
    assert (call["name"], call["args"]) == ("get_weather", {"city": "Paris"}) == (whole.tool_calls[0]["name"], whole.tool_calls[0]["args"])
    assert call["id"] and joined.content == ""
    assert joined.response_metadata["finish_reason"] == "tool_calls"


def test_langchain_second_turn_after_the_tool_message_answers(server, model_name, langchain_first_turn):
    from langchain_core.messages import ToolMessage

    prompt, first, _ = langchain_first_turn
    llm = _chat_openai(server, model_name, max_tokens=MAX_TOKENS, extra_body=constrained(ANSWER))
    call = first.tool_calls[0]
    messages = [*prompt, first, ToolMessage(get_weather(**call["args"]), tool_call_id=call["id"])]
    final = llm.bind_tools([get_weather]).invoke(messages)
    assert final.content == ANSWER and not final.tool_calls
    assert final.response_metadata["finish_reason"] == "stop"
    assert final.usage_metadata["output_token_details"]["reasoning"] == BUDGET


def test_langchain_responses_api_keeps_the_reasoning_item(server, model_name):
    from langchain_core.messages import HumanMessage

    # /v1/responses ignores structured_outputs and seed: the call is forced by tool_choice (a JSON of one possible
    # value), and greedy sampling keeps the thinking the same on every run.
    extra_body = {"thinking_token_budget": BUDGET}
    llm = _chat_openai(server, model_name, temperature=0.0, use_responses_api=True, max_tokens=MAX_TOKENS, extra_body=extra_body)
    message = llm.bind_tools([get_paris_weather], tool_choice="get_paris_weather").invoke([HumanMessage(QUESTION)])
    (call,) = message.tool_calls
    assert (call["name"], call["args"]) == ("get_paris_weather", {"city": "Paris"})
    kinds = [block["type"] for block in message.content]
    assert kinds == ["reasoning", "function_call"]
    reasoning = message.content[0]
    assert reasoning["content"][0]["type"] == "reasoning_text" and reasoning["content"][0]["text"]
    assert message.usage_metadata["output_token_details"]["reasoning"] == BUDGET


# ---------------------------------------------------------------- OpenAI Agents SDK


def _turn_settings(model_settings, input: Any):
    """The agent's settings with this turn's regex: the call first, the answer once the tool has answered."""
    answered = not isinstance(input, str) and any(dict(item).get("type") == "function_call_output" for item in input)
    extra = {**(model_settings.extra_body or {}), **constrained(ANSWER if answered else CALL)}
    return dataclasses.replace(model_settings, extra_body=extra)


@pytest.fixture(scope="module")
def agents_models() -> dict[str, type]:
    """The SDK's OpenAI models (tracing off: nothing leaves the machine), and each one sending the turn's regex."""
    from agents import OpenAIChatCompletionsModel, OpenAIResponsesModel, set_tracing_disabled

    set_tracing_disabled(True)

    class TurnConstrainedChat(OpenAIChatCompletionsModel):
        async def get_response(self, system_instructions, input, model_settings, *args, **kwargs):
            return await super().get_response(system_instructions, input, _turn_settings(model_settings, input), *args, **kwargs)

    class TurnConstrainedResponses(OpenAIResponsesModel):
        async def get_response(self, system_instructions, input, model_settings, *args, **kwargs):
            return await super().get_response(system_instructions, input, _turn_settings(model_settings, input), *args, **kwargs)

    return {"chat": TurnConstrainedChat, "responses": TurnConstrainedResponses, "plain_responses": OpenAIResponsesModel}


def _weather_agent(model, calls: list[str], paris_only: bool = False, **settings):
    from agents import Agent, ModelSettings, function_tool

    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return WEATHER

    def get_paris_weather(city: Literal["Paris"]) -> str:
        """The current weather in a city (only Paris: a forced call's JSON then has one value)."""
        calls.append(city)
        return WEATHER

    return Agent(
        name="weather",
        instructions="Answer briefly.",
        tools=[function_tool(get_paris_weather if paris_only else get_weather)],
        model=model,
        model_settings=ModelSettings(**{"temperature": 1.0, "max_tokens": MAX_TOKENS, **settings}),
        tool_use_behavior="stop_on_first_tool" if paris_only else "run_llm_again",
    )


def _run(server, model_class, calls: list[str], **agent_kwargs):
    """``Runner.run`` of the weather agent on ``model_class`` (one of the SDK's OpenAI models) against the server."""
    from agents import Runner

    async def go():
        client = server.async_openai_client()
        try:
            model = model_class(model=(await client.models.list()).data[0].id, openai_client=client)
            return await Runner.run(_weather_agent(model, calls, **agent_kwargs), QUESTION, max_turns=3)
        finally:
            await client.close()

    return asyncio.run(go())


def _reasoning_texts(result) -> list[str]:
    from agents.items import ReasoningItem

    texts = []
    for item in result.new_items:
        if isinstance(item, ReasoningItem):
            texts += [part.text for part in item.raw_item.summary] + [part.text for part in item.raw_item.content or []]
    return texts


def _item_kinds(result) -> list[str]:
    return [item.type for item in result.new_items]


def test_agents_sdk_chat_completions_model_runs_the_tool_and_answers(server, agents_models):
    calls: list[str] = []
    result = _run(server, agents_models["chat"], calls)
    assert calls == ["Paris"]
    assert result.final_output == ANSWER
    assert _item_kinds(result) == [
        "reasoning_item", "tool_call_item", "tool_call_output_item", "reasoning_item", "message_output_item",
    ]
    texts = _reasoning_texts(result)
    assert len(texts) == 2 and all(t.strip() for t in texts)  # reasoning_content, as each item's summary
    (call,) = [item.raw_item for item in result.new_items if item.type == "tool_call_item"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    (output,) = [item.output for item in result.new_items if item.type == "tool_call_output_item"]
    assert output == WEATHER
    assert [r.usage.output_tokens_details.reasoning_tokens for r in result.raw_responses] == [BUDGET, BUDGET]


def test_agents_sdk_responses_model_reads_the_reasoning_item_and_the_call(server, agents_models):
    # A forced tool_choice, greedy, and the run stops at the tool's output.
    calls: list[str] = []
    settings = {"temperature": 0.0, "tool_choice": "get_paris_weather", "extra_body": {"thinking_token_budget": BUDGET}}
    result = _run(server, agents_models["plain_responses"], calls, paris_only=True, **settings)
    assert calls == ["Paris"]
    assert result.final_output == WEATHER
    assert _item_kinds(result) == ["reasoning_item", "tool_call_item", "tool_call_output_item"]
    (text,) = _reasoning_texts(result)  # the reasoning item's reasoning_text content
    assert text
    assert result.raw_responses[0].usage.output_tokens_details.reasoning_tokens == BUDGET


def test_agents_sdk_responses_model_runs_the_tool_and_answers(server, agents_models):
    calls: list[str] = []
    result = _run(server, agents_models["responses"], calls)
    assert calls == ["Paris"]
    assert result.final_output == ANSWER
    assert _item_kinds(result) == [
        "reasoning_item", "tool_call_item", "tool_call_output_item", "reasoning_item", "message_output_item",
    ]
    assert all(t.strip() for t in _reasoning_texts(result))
