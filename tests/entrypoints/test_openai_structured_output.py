"""Structured output through the real server and the ``openai`` client: every reply matches its constraint.

50 random JSON schemas (seeded: nested objects, enums, arrays, required fields) on chat and
completions, ``json_object``, vLLM's guided_* extras and ``structured_outputs``, and the 400s.
"""
from __future__ import annotations

import asyncio
import json
import random
import re

import httpx
import jsonschema
import openai
import pytest
from openai_server_utils import API_KEY, RemoteServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
WORDS = ["name", "id", "color", "size", "city", "owner", "tags", "items", "count", "active", "kind", "score"]


@pytest.fixture(scope="module")
def server():
    args = ["--max-model-len", "1024", "--kv-cache-memory", "96MiB", "--max-num-seqs", "32",
            "--api-key", API_KEY, "--disable-uvicorn-access-log"]
    srv = RemoteServer(args)
    yield srv
    srv.terminate()
    srv.cleanup()


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """A JSON schema whose every instance is short: strings, arrays and integers are bounded."""
    kinds = ["string", "integer", "boolean", "enum", "array"] + (["object"] * 2 if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "integer":
        lo = rng.randint(-100, 100)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", "x-1"], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": 0, "maxItems": rng.randint(1, 3)}
    return random_object(rng, depth + 1)


def random_object(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(WORDS, rng.randint(1, 4))
    props = {n: random_schema(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


async def _one(client: openai.AsyncOpenAI, i: int, schema: dict) -> tuple[str, str]:
    rf = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
    if i % 2:
        resp = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Reply with a JSON object for a record. Schema: {json.dumps(schema)}"}],
            response_format=rf, max_tokens=500, temperature=0.8, seed=i,
        )
        return resp.choices[0].message.content, resp.choices[0].finish_reason
    resp = await client.completions.create(
        model=MODEL, prompt="A JSON record:", max_tokens=500, temperature=0.8, seed=i, extra_body={"response_format": rf}
    )
    return resp.choices[0].text, resp.choices[0].finish_reason


def test_fifty_random_schemas_validate(server):
    rng = random.Random(1234)
    schemas = [random_object(rng) for _ in range(50)]

    async def run():
        client = server.async_openai_client(timeout=600)
        return await asyncio.gather(*(_one(client, i, s) for i, s in enumerate(schemas)))

    for schema, (text, finish) in zip(schemas, asyncio.run(run())):
        assert finish == "stop", (schema, text)
        jsonschema.validate(json.loads(text), schema)


def test_json_object_parses_streamed_and_not(server):
    # A free-form object has no bound, and this small model can loop (keys repeating, digits
    # running on) past any max_tokens: the prompts name the keys, and decoding is greedy.
    client = server.openai_client(timeout=300)
    for animal in ("cat", "dog", "bird"):
        messages = [{"role": "user", "content": f"Give me a JSON object with the keys name and age for a {animal}."}]
        resp = client.chat.completions.create(
            model=MODEL, messages=messages, response_format={"type": "json_object"}, max_tokens=300, temperature=0
        )
        assert resp.choices[0].finish_reason == "stop", resp.choices[0].message.content
        assert isinstance(json.loads(resp.choices[0].message.content), dict)
        stream = client.chat.completions.create(
            model=MODEL, messages=messages, response_format={"type": "json_object"}, max_tokens=300, temperature=0, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == resp.choices[0].message.content


def test_guided_extras(server):
    client = server.openai_client(timeout=300)

    def complete(**extra) -> str:
        resp = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=40, temperature=1.0, seed=3, extra_body=extra)
        return resp.choices[0].text

    assert complete(guided_choice=["yes", "no", "maybe"]) in ("yes", "no", "maybe")
    assert re.fullmatch(r"\d{3}-[a-z]{2,4}", complete(guided_regex=r"\d{3}-[a-z]{2,4}"))
    assert complete(guided_grammar='root ::= "ab" rest\nrest ::= "c" | "d"') in ("abc", "abd")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    jsonschema.validate(json.loads(complete(guided_json=schema)), schema)
    jsonschema.validate(json.loads(complete(structured_outputs={"json": schema})), schema)
    assert complete(structured_outputs={"choice": ["left", "right"]}) in ("left", "right")


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objec"}}}}, "objec"),
        ({"guided_regex": "(unclosed"}, "regex"),
        ({"guided_grammar": "root ::= undefined_rule"}, "grammar"),
        ({"guided_choice": []}, "choice"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "only one"),
        ({"structured_outputs": {"bogus": 1}}, "structured_outputs"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format"),
    ],
)
def test_bad_constraints_are_400(server, extra, match):
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        resp = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 5, **extra}, headers=AUTH, timeout=60)
        assert resp.status_code == 400, resp.text
        assert match in resp.json()["error"]["message"]
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=AUTH, timeout=60).status_code == 200


def test_auto_tool_choice_needs_the_server_flags(server):
    # This server runs without --enable-auto-tool-choice: "auto" is refused, no tool_choice means "none".
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 2}
    resp = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "tool_choice": "auto"}, headers=AUTH, timeout=60)
    assert resp.status_code == 400 and "--enable-auto-tool-choice" in resp.json()["error"]["message"]
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60)
    assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["tool_calls"] == []
