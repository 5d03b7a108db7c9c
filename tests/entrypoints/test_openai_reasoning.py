"""Reasoning end to end with the official ``openai`` client: a tiny random checkpoint whose chat
template opens the thinking, served with ``--reasoning-parser qwen3``. The thinking budget forces
the end marker at exactly the budget and the answer follows; a JSON schema (or a forced tool call)
constrains only what follows the thinking; the Responses API returns a reasoning item."""
from __future__ import annotations

import json

import jsonschema
import pytest
from openai_server_utils import SERVER_ARGS, RemoteServer, thinking_llama_args

from pagellm.models.loader import default_model_path
from pagellm.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "Is the sky blue?"}]
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def end_ids() -> list[int]:
    return load_tokenizer(default_model_path()).encode("</think>", add_special_tokens=False)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RemoteServer([*thinking_llama_args(tmp_path_factory.mktemp("thinking-llama")), *SERVER_ARGS])
    yield srv
    srv.stop_and_check()


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def _chat(client, **kwargs):
    extra = kwargs.pop("extra_body", {})
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=MESSAGES,
        temperature=0.0,
        logprobs=True,
        extra_body={"return_tokens_as_token_ids": True, **extra},
        **kwargs,
    )


def _token_ids(choice) -> list[int]:
    return [int(t.token.split(":")[1]) for t in choice.logprobs.content]


@pytest.mark.parametrize("budget", [0, 16])
def test_budget_forces_the_end_at_exactly_the_budget_and_the_answer_follows(client, end_ids, budget):
    r = _chat(client, max_tokens=40, extra_body={"thinking_token_budget": budget})
    choice = r.choices[0]
    ids = _token_ids(choice)
    assert len(ids) == 40
    # The first `budget` tokens are the model's own thinking; the end marker comes right after.
    assert ids[budget : budget + len(end_ids)] == end_ids
    assert end_ids not in [ids[i : i + len(end_ids)] for i in range(budget)]
    message = choice.message.model_dump()
    assert message["reasoning"] == message["reasoning_content"]
    assert (message["reasoning"] or "") == load_tokenizer(default_model_path()).decode(ids[:budget])
    assert message["content"]  # the answer, in the tokens left after the thinking
    assert r.usage.completion_tokens_details.reasoning_tokens == budget  # the thinking's own tokens, not its marker


def test_unlimited_thinking_takes_every_token(client, end_ids):
    r = _chat(client, max_tokens=24)
    choice = r.choices[0]
    ids = _token_ids(choice)
    assert end_ids not in [ids[i : i + len(end_ids)] for i in range(len(ids))]
    message = choice.message.model_dump()
    assert message["reasoning"] and not message["content"]
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens_details.reasoning_tokens == 24


def test_streamed_reasoning_and_answer_join_into_the_whole(client):
    kwargs = {"max_tokens": 40, "extra_body": {"thinking_token_budget": 16}}
    whole = _chat(client, **kwargs).choices[0].message.model_dump()
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=MESSAGES,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=40,
        extra_body={"thinking_token_budget": 16},
    )
    reasoning, content, usage = "", "", None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            delta = c.delta.model_dump()
            reasoning += delta.get("reasoning") or ""
            content += delta.get("content") or ""
            assert delta.get("reasoning") == delta.get("reasoning_content")
    assert reasoning == whole["reasoning"] and content == whole["content"]
    assert usage.completion_tokens_details.reasoning_tokens == 16


def test_json_schema_constrains_only_the_answer(client):
    r = _chat(
        client,
        max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        extra_body={"thinking_token_budget": 8},
    )
    message = r.choices[0].message.model_dump()
    assert message["reasoning"]  # unconstrained thinking first
    jsonschema.validate(json.loads(message["content"]), SCHEMA)


def test_thinking_turned_off_by_the_template_gives_an_answer_only(client):
    r = _chat(
        client,
        max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    message = r.choices[0].message.model_dump()
    assert not message["reasoning"]
    jsonschema.validate(json.loads(message["content"]), SCHEMA)
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_forced_tool_call_after_thinking(client):
    tool = {
        "type": "function",
        "function": {"name": "answer", "parameters": SCHEMA},
    }
    r = _chat(
        client,
        max_tokens=120,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "answer"}},
        extra_body={"thinking_token_budget": 4},
    )
    message = r.choices[0].message.model_dump()
    assert message["reasoning"]
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "answer"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA)


def test_budget_is_refused_when_out_of_range(client):
    import openai

    with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
        _chat(client, max_tokens=4, extra_body={"thinking_token_budget": -1})


def test_responses_api_returns_a_reasoning_item(client):
    r = client.responses.create(
        model=client.models.list().data[0].id, input="Is the sky blue?", max_output_tokens=40, temperature=0.0, reasoning={"effort": "none"}
    )
    assert [item.type for item in r.output] == ["message"]  # effort "none": the template turns thinking off
    r = client.responses.create(
        model=client.models.list().data[0].id,
        input="Is the sky blue?",
        max_output_tokens=40,
        temperature=0.0,
        extra_body={"thinking_token_budget": 4},
    )
    assert r.output[0].type == "reasoning" and r.output[1].type == "message"
    assert r.output[0].content[0].text and r.output[1].content[0].text
    assert r.usage.output_tokens_details.reasoning_tokens == 4
    events = list(
        client.responses.create(
            model=client.models.list().data[0].id, input="Is the sky blue?", max_output_tokens=24, temperature=0.0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert "response.reasoning_text.delta" in kinds and kinds[-1] == "response.incomplete"
    final = events[-1].response
    assert final.output[0].type == "reasoning" and final.output[0].content[0].text


def test_prompt_logprobs_and_token_ids_on_chat_and_completions(server, client):
    import httpx

    model = client.models.list().data[0].id
    headers = {"Authorization": f"Bearer {client.api_key}"}
    body = {"model": model, "messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 1, "return_tokens_as_token_ids": True}
    chat = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=headers, timeout=60).json()
    steps = chat["prompt_logprobs"]
    assert len(steps) == chat["usage"]["prompt_tokens"] and steps[0] is None
    for step in steps[1:]:
        # The prompt's own token (any rank) and the top-1, each with a rank, named by id.
        assert 1 <= len(step) <= 2 and all(v["decoded_token"] == f"token_id:{k}" and v["rank"] >= 1 for k, v in step.items())
    prompt_ids = [1, 2, 3, 4, 5]
    r = client.completions.create(
        model=model, prompt=prompt_ids, max_tokens=3, logprobs=2, extra_body={"prompt_logprobs": 0, "return_tokens_as_token_ids": True}
    )
    choice = r.choices[0].model_dump()
    assert all(t.startswith("token_id:") for t in choice["logprobs"]["tokens"])
    assert [list(step) if step else None for step in choice["prompt_logprobs"]] == [None] + [[str(t)] for t in prompt_ids[1:]]
