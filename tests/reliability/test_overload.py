"""Overload: far more clients than the KV cache holds, and a bounded waiting queue.

* 256 concurrent streaming clients against a pool that holds about a tenth of them: every one
  completes (the preempted ones included), and each greedy request returns exactly what its prompt
  returns when it runs alone. Distinct prompts also show that no request reads another's output.
* With ``--max-waiting-requests``, the requests beyond the bound get an immediate 503 in OpenAI's
  shape with ``Retry-After`` (never a timeout), and the admitted ones still complete.
"""
from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest
from reliability_utils import AUTH, MODEL, assert_openai_error, metric_value, run, stream_request

pytestmark = pytest.mark.slow

ANIMALS = ["fox", "owl", "whale", "tiger", "rabbit", "crow", "otter", "horse", "bee", "frog", "wolf", "cat", "goat", "moth", "crab", "lynx"]
PLACES = ["a lighthouse", "the desert", "a library", "an old ship", "the mountains", "a busy market", "a frozen lake", "a castle"]
# 32-35 tokens each: with 16 new tokens a request ends in its 3rd or 4th block of 16.
PROMPTS = [
    f"Story {i}: Write a short tale about a clever {a} who lives near {PLACES[i % 8]} and dreams of flying over the sea. "
    f"Once upon a time, the {a}"
    for i, a in enumerate(ANIMALS)
]
NUM_CLIENTS = 256
MAX_TOKENS = 16


def greedy_body(prompt: str) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}


def test_256_streaming_clients_on_a_tenth_of_the_kv_they_need(main_server):
    url = main_server.url
    # What each prompt returns when it runs alone.
    alone = {}
    for prompt in PROMPTS:
        resp = httpx.post(f"{url}/v1/completions", json=greedy_body(prompt), headers=AUTH, timeout=120)
        assert resp.status_code == 200, resp.text
        alone[prompt] = resp.json()["choices"][0]["text"]
    preemptions_before = main_server.debug()["total_num_preemptions"]

    async def storm():
        limits = httpx.Limits(max_connections=NUM_CLIENTS + 8, max_keepalive_connections=NUM_CLIENTS + 8)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=60), limits=limits) as client:
            bodies = [{**greedy_body(PROMPTS[i % len(PROMPTS)]), "stream_options": {"include_usage": True}} for i in range(NUM_CLIENTS)]
            return await asyncio.gather(*(stream_request(client, url, "/v1/completions", b) for b in bodies))

    results = run(storm())
    assert len(results) == NUM_CLIENTS
    for i, result in enumerate(results):
        prompt = PROMPTS[i % len(PROMPTS)]
        assert result.status == 200 and result.done and not result.errors, (i, result)
        assert result.finish_reasons == {0: "length"}, (i, result)
        assert result.usage["completion_tokens"] == MAX_TOKENS
        assert result.texts[0] == alone[prompt], (i, prompt, result.texts[0], alone[prompt])
    snap = main_server.debug()
    # The pool really was too small: running requests were evicted and recomputed, and still
    # produced the same tokens.
    assert snap["total_num_preemptions"] > preemptions_before, snap
    print(f"{NUM_CLIENTS} streams completed, {snap['total_num_preemptions'] - preemptions_before} preemptions")
    text = main_server.metrics()
    assert metric_value(text, "pagellm:num_preemptions_total") > 0


def test_bounded_waiting_queue_answers_503_with_retry_after(cached_server):
    url = cached_server.url
    num_clients = 96

    async def burst():
        limits = httpx.Limits(max_connections=num_clients + 8)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=60), limits=limits) as client:
            bodies = [{**greedy_body(f"Request {i}: {PROMPTS[i % len(PROMPTS)]}"), "max_tokens": 8} for i in range(num_clients)]
            streamed = [stream_request(client, url, "/v1/completions", b) for b in bodies[: num_clients // 2]]
            plain = [client.post(f"{url}/v1/completions", json=b, headers=AUTH) for b in bodies[num_clients // 2 :]]
            return await asyncio.gather(*streamed), await asyncio.gather(*plain)

    streamed, plain = run(burst())
    statuses = Counter([r.status for r in streamed] + [r.status_code for r in plain])
    assert set(statuses) == {200, 503}, statuses
    # At least the bound's worth (plus the running batch) was admitted; the rest were refused.
    assert statuses[200] >= 16 and statuses[503] > 0, statuses
    print(f"bounded queue: {dict(statuses)}")
    for r in streamed:
        if r.status == 200:
            assert r.done and not r.errors and r.finish_reasons == {0: "length"}, r
        else:
            err = r.body["error"]
            assert err["code"] == 503 and err["type"] == "ServiceUnavailableError" and "overloaded" in err["message"]
    for resp in plain:
        if resp.status_code == 200:
            assert resp.json()["choices"][0]["finish_reason"] == "length"
        else:
            err = assert_openai_error(resp, 503)
            assert "overloaded" in err["message"] and int(resp.headers["retry-after"]) >= 1
    # Once the burst has drained, the server admits again.
    resp = httpx.post(f"{url}/v1/completions", json=greedy_body(PROMPTS[0]), headers=AUTH, timeout=120)
    assert resp.status_code == 200


def test_streamed_503_carries_retry_after(cached_server):
    """A refused stream is refused before it starts: an HTTP 503 with Retry-After, not an SSE error."""
    url = cached_server.url

    async def burst():
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=80)) as client:

            async def one(i: int):
                body = {**greedy_body(f"Burst {i}: {PROMPTS[i % 16]}"), "max_tokens": 4, "stream": True}
                async with client.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as resp:
                    await resp.aread()
                    return resp

            return await asyncio.gather(*(one(i) for i in range(64)))

    responses = run(burst())
    refused = [r for r in responses if r.status_code == 503]
    assert refused and all(r.status_code in (200, 503) for r in responses)
    for r in refused:
        assert r.headers["retry-after"] == "1"
        assert r.headers["content-type"].startswith("application/json")
        assert r.json()["error"]["type"] == "ServiceUnavailableError"
