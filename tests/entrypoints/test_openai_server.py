"""The real server on the default model, driven by the official ``openai`` client and raw httpx."""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


def metric_value(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert len(models) == 1
    assert models[0].id == "SmolLM2-135M-Instruct"
    assert models[0].model_extra["max_model_len"] == 512


def test_completion_greedy_with_usage(client):
    resp = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=8, temperature=0)
    assert resp.id.startswith("cmpl-") and resp.object == "text_completion"
    choice = resp.choices[0]
    assert choice.text and choice.finish_reason == "length" and choice.index == 0
    assert resp.usage.completion_tokens == 8
    assert resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 8
    assert resp.usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_text_equals_non_streamed_for_chinese_prompt(client):
    kwargs = dict(model="SmolLM2-135M-Instruct", prompt="请用中文介绍一下北京。北京是", max_tokens=24, temperature=0)
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == full.choices[0].text
    # No character is broken inside the text. Where max_tokens cut the last character in half (which
    # depends on the CPU's kernels through the greedy tokens), the finished text ends with it as
    # U+FFFD, as tokenizer.decode shows it (tests/engine/test_detokenizer.py).
    whole = streamed.rstrip("\ufffd") if full.choices[0].finish_reason == "length" else streamed
    assert "\ufffd" not in whole
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def test_chat_streamed_equals_non_streamed(client):
    full = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=32, temperature=0)
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    message = full.choices[0].message
    assert message.role == "assistant" and message.content
    assert "Paris" in message.content
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=32, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert full.usage.completion_tokens > 0 and full.usage.prompt_tokens > 10


def test_n_and_seed_are_reproducible(client):
    kwargs = dict(model="SmolLM2-135M-Instruct", prompt="Once upon a time", max_tokens=12, temperature=1.0, seed=1234, n=3)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1  # the samples get seeds seed+i: they differ
    assert 3 <= first.usage.completion_tokens <= 36


def test_stop_string_ends_the_text(client):
    base = client.completions.create(model="SmolLM2-135M-Instruct", prompt="1, 2, 3, 4,", max_tokens=16, temperature=0)
    text = base.choices[0].text
    assert " 6" in text, text
    stopped = client.completions.create(model="SmolLM2-135M-Instruct", prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[" 6"])
    choice = stopped.choices[0]
    assert choice.text == text[: text.index(" 6")]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == " 6"


def test_completion_logprobs(client):
    resp = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The sky is", max_tokens=6, temperature=0, logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == resp.choices[0].text
    assert all(x <= 0 for x in lp.token_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 2 <= len(top) <= 3 and top[token] == pytest.approx(logprob)
        assert logprob == pytest.approx(max(top.values()))  # greedy: the chosen token is the likeliest


def test_completion_echo(client):
    resp = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt="Hello there", max_tokens=3, temperature=0, echo=True, logprobs=1
    )
    choice = resp.choices[0]
    assert choice.text.startswith("Hello there")
    assert choice.logprobs.token_logprobs[0] is None
    assert len(choice.logprobs.tokens) == resp.usage.prompt_tokens + 3


def test_chat_logprobs(client):
    resp = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    assert "".join(c.token for c in content) == resp.choices[0].message.content
    for item in content:
        assert item.logprob <= 0 and bytes(item.bytes).decode("utf-8", errors="replace") == item.token
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.top_logprobs[0].token == item.token  # greedy


def test_token_id_prompts_and_tokenize_roundtrip(server, client, auth_headers):
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "The capital of France is"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text == "The capital of France is"
    by_ids = client.completions.create(model="SmolLM2-135M-Instruct", prompt=tokens["tokens"], max_tokens=6, temperature=0)
    by_text = client.completions.create(model="SmolLM2-135M-Instruct", prompt="The capital of France is", max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model="SmolLM2-135M-Instruct", prompt=["Hi", "Bye"], max_tokens=2, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    chat_tokens = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}).json()
    chat = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=1)
    assert chat.usage.prompt_tokens == chat_tokens["count"]


def test_version_and_health(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json() == {"version": "0.1.0"}


@pytest.mark.parametrize(
    "body, status, match",
    [
        (b'{"prompt": "x", "max_tokens": ', 400, "not valid json"),
        ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"prompt": "x", "n": 1000}, 400, "n must be"),
        ({"prompt": "x", "max_tokens": 600}, 400, "512"),
        ({"prompt": [10**9]}, 400, "out of range"),
        ({"prompt": "x", "logit_bias": {"999999": 1}}, 400, "vocabulary"),
        (b'{"prompt": "\\udcff", "max_tokens": 2}', 400, "tokenize"),
        ({"prompt": "x", "model": "gpt-4"}, 404, "gpt-4"),
    ],
)
def test_errors_are_openai_shaped_and_harmless(server, client, auth_headers, body, status, match):
    kwargs = (
        {"content": body, "headers": {**auth_headers, "content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body, "headers": auth_headers}
    )
    resp = httpx.post(f"{server.url}/v1/completions", timeout=30, **kwargs)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == status and match in err["message"].lower() and {"type", "param"} <= set(err)
    ok = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)
    assert ok.choices[0].text


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=CHAT, max_completion_tokens=10_000)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)


def test_auth_and_body_limit(server, auth_headers):
    resp = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"})
    assert resp.status_code == 401 and resp.json()["error"]["code"] == 401
    resp = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer not-the-key"})
    assert resp.status_code == 401
    big = b'{"prompt": "' + b"a" * (9 << 20) + b'"}'
    resp = httpx.post(f"{server.url}/v1/completions", content=big, headers={**auth_headers, "content-type": "application/json"})
    assert resp.status_code == 413 and resp.json()["error"]["type"] == "RequestEntityTooLargeError"
    assert httpx.get(f"{server.url}/v1/models", headers=auth_headers).status_code == 200


def test_disconnecting_streams_free_their_blocks(server, auth_headers):
    async def client_that_leaves(http: httpx.AsyncClient, i: int) -> int:
        body = {
            "prompt": f"Write a long story about robot number {i}.",
            "max_tokens": 200,
            "stream": True,
            "temperature": 0.8,
            "ignore_eos": True,
        }
        events = 0
        async with http.stream("POST", f"{server.url}/v1/completions", json=body, headers=auth_headers) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    events += 1
                    if events == 2:
                        break  # leave mid-stream: closing the response drops the connection
        return events

    async def main():
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            return await asyncio.gather(*(client_that_leaves(http, i) for i in range(20)))

    assert asyncio.run(main()) == [2] * 20
    text = ""
    for _ in range(100):
        text = httpx.get(f"{server.url}/metrics").text
        if metric_value(text, "pagellm:kv_cache_usage_perc") == 0.0 and metric_value(text, "pagellm:num_requests_running") == 0:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert metric_value(text, "pagellm:kv_cache_usage_perc") == 0.0
    assert metric_value(text, "pagellm:num_requests_running") == 0.0
    assert metric_value(text, "pagellm:num_requests_waiting") == 0.0
    assert metric_value(text, 'pagellm:request_success_total{finished_reason="abort",model_name="SmolLM2-135M-Instruct"}') >= 20


def test_disconnecting_non_streamed_request_aborts_it(server, auth_headers):
    def num_aborted() -> float:
        text = httpx.get(f"{server.url}/metrics").text
        return metric_value(text, 'pagellm:request_success_total{finished_reason="abort",model_name="SmolLM2-135M-Instruct"}')

    before = num_aborted()
    body = {"prompt": "Tell me everything about the sea.", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers=auth_headers, timeout=httpx.Timeout(5, read=1.0))
    for _ in range(100):
        text = httpx.get(f"{server.url}/metrics").text
        if num_aborted() == before + 1 and metric_value(text, "pagellm:num_requests_running") == 0:
            break
        asyncio.run(asyncio.sleep(0.1))
    assert num_aborted() == before + 1
    assert metric_value(text, "pagellm:kv_cache_usage_perc") == 0.0


def test_metrics_names(server, client):
    client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=3)
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "pagellm:num_requests_running",
        "pagellm:num_requests_waiting",
        "pagellm:kv_cache_usage_perc",
        "pagellm:prefix_cache_queries_total",
        "pagellm:prefix_cache_hits_total",
        "pagellm:num_preemptions_total",
        "pagellm:prompt_tokens_total",
        "pagellm:generation_tokens_total",
        "pagellm:time_to_first_token_seconds_count",
        "pagellm:inter_token_latency_seconds_count",
        "pagellm:e2e_request_latency_seconds_count",
        "pagellm:request_queue_time_seconds_count",
    ):
        assert metric_value(text, name) >= 0
    assert metric_value(text, "pagellm:generation_tokens_total") >= 3
    assert metric_value(text, "pagellm:request_queue_time_seconds_count") >= 1
    assert 'pagellm:request_success_total{finished_reason="length"' in text
    # The memory plan, as measured at start-up.
    assert 0 < metric_value(text, "pagellm:model_checkpoint_bytes") <= metric_value(text, "pagellm:model_weight_bytes")
    assert metric_value(text, "pagellm:kv_cache_bytes") > 0 and metric_value(text, "pagellm:kv_cache_tokens") > 0
    assert metric_value(text, "pagellm:activation_reserve_bytes") > 0
    assert re.search(r'^pagellm:cache_config_info\{.*cache_dtype="bfloat16".*\} 1\.0$', text, re.MULTILINE)
    assert json.loads(httpx.get(f"{server.url}/version").text)["version"]


def test_embeddings_on_the_generate_runner_are_400(client):
    with pytest.raises(openai.BadRequestError, match="The model does not support Embeddings API"):
        client.embeddings.create(model="SmolLM2-135M-Instruct", input="hello")
