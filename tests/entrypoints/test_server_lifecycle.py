"""``pagellm serve`` as users run it: API key from the environment, overload 503s, SIGTERM drain."""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from openai_server_utils import RemoteServer

pytestmark = pytest.mark.slow

ENV_KEY = "sk-from-env"


@pytest.fixture(scope="module")
def small_server():
    srv = RemoteServer(
        [
            "--max-model-len", "4096",
            "--kv-cache-memory", "192MiB",  # holds the whole 4096-token context
            "--max-num-seqs", "2",
            "--max-waiting-requests", "1",
            "--shutdown-timeout", "4",
        ],
        use_cli=True,
        env={"PAGELLM_API_KEY": ENV_KEY},
    )
    yield srv
    srv.kill()


def stream_completion(url: str, body: dict, result: dict, first_chunk: threading.Event) -> None:
    headers = {"Authorization": f"Bearer {ENV_KEY}"}
    result["finish_reason"], result["done"], result["num_chunks"] = None, False, 0
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=headers, timeout=120) as resp:
        result["status"] = resp.status_code
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                result["done"] = True
            elif line.startswith("data: "):
                chunk = json.loads(line[len("data: ") :])
                result["num_chunks"] += 1
                result["finish_reason"] = chunk["choices"][0]["finish_reason"] or result["finish_reason"]
                first_chunk.set()
    first_chunk.set()


def test_api_key_from_environment(small_server):
    assert httpx.get(f"{small_server.url}/v1/models").status_code == 401
    assert httpx.get(f"{small_server.url}/v1/models", headers={"Authorization": f"Bearer {ENV_KEY}"}).status_code == 200


def test_overload_is_503_with_retry_after(small_server):
    headers = {"Authorization": f"Bearer {ENV_KEY}"}
    body = {"prompt": "Tell me a story.", "max_tokens": 12, "ignore_eos": True}
    responses: list[httpx.Response] = []

    def post() -> None:
        responses.append(httpx.post(f"{small_server.url}/v1/completions", json=body, headers=headers, timeout=120))

    threads = [threading.Thread(target=post) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    statuses = sorted(r.status_code for r in responses)
    assert 200 in statuses and 503 in statuses, statuses
    assert set(statuses) == {200, 503}
    refused = next(r for r in responses if r.status_code == 503)
    assert refused.headers["retry-after"]
    assert refused.json()["error"]["type"] == "ServiceUnavailableError" and "overloaded" in refused.json()["error"]["message"]
    assert httpx.post(f"{small_server.url}/v1/completions", json=body, headers=headers, timeout=120).status_code == 200


def test_prefix_cache_hits_show_in_usage_and_cache_salt_isolates(small_server):
    headers = {"Authorization": f"Bearer {ENV_KEY}"}
    body = {"prompt": "You are a helpful assistant who answers briefly. " * 6 + "What is 2 + 2?", "max_tokens": 1}

    def cached_tokens(extra: dict) -> tuple[int, int]:
        resp = httpx.post(f"{small_server.url}/v1/completions", json={**body, **extra}, headers=headers, timeout=120)
        usage = resp.json()["usage"]
        return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]

    cached_tokens({})
    hits, num_prompt = cached_tokens({})
    assert num_prompt > 32 and hits >= 32 and hits % 16 == 0 and hits < num_prompt
    assert cached_tokens({"cache_salt": "tenant-b"})[0] == 0  # another tenant shares no blocks
    assert cached_tokens({"cache_salt": "tenant-b"})[0] == hits
    metrics = httpx.get(f"{small_server.url}/metrics").text
    assert 'pagellm:prefix_cache_hits_total{model_name="SmolLM2-135M-Instruct"} 0.0' not in metrics


def test_sigterm_drains_in_flight_then_exits_zero(small_server):
    url = small_server.url
    short, long = {}, {}
    short_started, long_started = threading.Event(), threading.Event()
    body = {"prompt": "Count with me: 1, 2, 3,", "ignore_eos": True, "temperature": 0}
    threads = [
        threading.Thread(target=stream_completion, args=(url, {**body, "max_tokens": 3000}, long, long_started)),
        threading.Thread(target=stream_completion, args=(url, {**body, "max_tokens": 3}, short, short_started)),
    ]
    # One after the other: with --max-waiting-requests 1, two requests sent together race, and the
    # second is refused (503) whenever it arrives before the engine has taken the first one.
    threads[0].start()
    assert long_started.wait(60)
    threads[1].start()
    assert short_started.wait(60)
    t0 = time.monotonic()
    small_server.proc.send_signal(15)
    time.sleep(0.5)
    try:
        refused = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {ENV_KEY}"}, timeout=10)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    except httpx.ConnectError:
        pass  # already closed its socket: also a refusal
    for t in threads:
        t.join(60)
    assert small_server.proc.wait(30) == 0, small_server.read_log()
    # The short request finished normally; the long one was cut at --shutdown-timeout, with a clean end.
    assert short == {"status": 200, "finish_reason": "length", "done": True, "num_chunks": 3}
    assert long["status"] == 200 and long["done"] and long["finish_reason"] == "abort"
    assert 3.5 < time.monotonic() - t0 < 30
    assert "received SIGTERM" in small_server.read_log()
