"""Clients that leave at random points, and clients that read very slowly.

Aborted requests must give their blocks back at once (``/metrics`` KV usage back to 0 with prefix
caching off, nothing running), and a slow reader must never hold the engine: the engine finishes
the slow client's request and frees its blocks while that client has read only its first chunk.
"""
from __future__ import annotations

import asyncio
import json
import random
import socket
import time

import httpx
import pytest
from fake_engine import FakeEngine
from openai_server_utils import API_KEY
from reliability_utils import AUTH, MODEL, StreamResult, finished_count, metric_value, parse_sse_event, run, stream_request

from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.metrics import EngineMetrics
from pagellm.entrypoints.openai.api_server import build_app

LONG = {"model": MODEL, "max_tokens": 64, "ignore_eos": True, "temperature": 0.8, "seed": 7}


def raw_request(port: int, body: dict, path: str = "/v1/completions") -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode()
    return head + data


async def leave_before_first_byte(port: int, body: dict, wait_s: float) -> str:
    """Sends the whole request, then closes without reading a byte of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw_request(port, body))
    await writer.drain()
    await asyncio.sleep(wait_s)
    writer.close()
    return "before_first_byte"


async def leave_mid_body(port: int, body: dict) -> str:
    """Declares a body, sends half of it, closes."""
    data = raw_request(port, body)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data[: len(data) - 20])
    await writer.drain()
    await asyncio.sleep(0.05)
    writer.close()
    return "mid_body"


async def leave_mid_stream(client: httpx.AsyncClient, url: str, body: dict, after_events: int) -> str:
    events = 0
    async with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=AUTH) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                events += 1
                if events >= after_events:
                    break  # closing the response drops the connection
    assert events == after_events
    return "mid_stream"


async def stay_to_the_end(client: httpx.AsyncClient, url: str, body: dict, path: str) -> str:
    if path.endswith("chat/completions"):
        body = {k: v for k, v in body.items() if k != "prompt"} | {"messages": [{"role": "user", "content": body["prompt"]}]}
    result = await stream_request(client, url, path, body)
    assert result.status == 200 and result.done and not result.errors, result
    assert result.finish_reasons == {0: "length"}, result
    return "complete"


@pytest.mark.slow
def test_random_disconnects_free_every_block(main_server):
    url, port = main_server.url, main_server.port
    rng = random.Random(1234)
    aborted_before = finished_count(main_server.metrics(), "abort")

    async def crowd():
        tasks = []
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=80)) as client:
            for i in range(60):
                body = {**LONG, "prompt": f"Client {i} writes a very long letter about the weather and"}
                mode = rng.choice(["before_first_byte", "before_first_byte_stream", "mid_body", "mid_stream", "complete", "complete_chat"])
                if mode == "before_first_byte":
                    tasks.append(leave_before_first_byte(port, body, rng.uniform(0, 0.5)))
                elif mode == "before_first_byte_stream":
                    tasks.append(leave_before_first_byte(port, {**body, "stream": True}, rng.uniform(0, 0.5)))
                elif mode == "mid_body":
                    tasks.append(leave_mid_body(port, body))
                elif mode == "mid_stream":
                    tasks.append(leave_mid_stream(client, url, body, rng.randint(1, 4)))
                elif mode == "complete":
                    tasks.append(stay_to_the_end(client, url, {**body, "max_tokens": 8}, "/v1/completions"))
                else:
                    tasks.append(stay_to_the_end(client, url, {**body, "max_tokens": 8}, "/v1/chat/completions"))
            return await asyncio.gather(*tasks)

    outcomes = run(crowd())
    counts = {m: outcomes.count(m) for m in set(outcomes)}
    print(f"client behaviours: {counts}")
    assert set(counts) >= {"before_first_byte", "mid_body", "mid_stream", "complete"}, counts
    # Every request is gone from the engine, every block is back (also checked after each test).
    snap = main_server.assert_pool_whole()
    assert snap["num_used_blocks"] == 0
    text = main_server.metrics()
    assert metric_value(text, "pagellm:kv_cache_usage_perc") == 0.0
    assert metric_value(text, "pagellm:num_requests_running") == 0.0
    # Clients that left mid-stream had 64-token requests in flight: each was aborted, not run out.
    assert finished_count(text, "abort") - aborted_before >= counts["mid_stream"]


@pytest.mark.slow
def test_slow_reader_does_not_hold_the_engine(main_server):
    """The slow client's socket buffer is tiny and it stops reading after the first event: its
    request still finishes in the engine (blocks freed) and other clients are served meanwhile.
    (The kernel may buffer this little output; the next test blocks the ASGI send itself.)"""
    url = main_server.url
    body = {"model": MODEL, "prompt": "List the planets of the solar system and describe each:", "max_tokens": 48,
            "temperature": 0, "ignore_eos": True, "logprobs": 20, "n": 4}
    reference = httpx.post(f"{url}/v1/completions", json=body, headers=AUTH, timeout=120).json()
    small_buffer = httpx.AsyncHTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)])

    async def scenario():
        async with httpx.AsyncClient(transport=small_buffer, timeout=300) as slow_client:
            async with slow_client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, headers=AUTH) as resp:
                assert resp.status_code == 200
                result = StreamResult(200)
                lines = resp.aiter_lines()
                async for line in lines:
                    parse_sse_event(line, result, chat=False)
                    if result.num_chunks:
                        break
                assert result.num_chunks == 1 and not result.done
                # The client now reads nothing. The engine must finish the request anyway.
                deadline = time.monotonic() + 120
                snap = main_server.debug()
                while (snap["num_streams"] or snap["num_block_owners"]) and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                    snap = main_server.debug()
                assert snap["num_streams"] == 0 and snap["num_block_owners"] == 0 and snap["num_used_blocks"] == 0, snap
                assert result.num_chunks == 1  # still unread
                # Meanwhile another client is served from start to end.
                async with httpx.AsyncClient(timeout=120) as other:
                    other_result = await stream_request(
                        other, url, "/v1/completions", {"model": MODEL, "prompt": "Hello there,", "max_tokens": 12, "ignore_eos": True}
                    )
                assert other_result.done and other_result.finish_reasons == {0: "length"}
                # Now the slow client reads the rest, a little at a time: nothing was lost.
                async for line in lines:
                    parse_sse_event(line, result, chat=False)
                    await asyncio.sleep(0.001)
        return result

    result = run(scenario())
    assert result.done and not result.errors
    assert result.finish_reasons == {i: "length" for i in range(4)}
    assert [result.texts[i] for i in range(4)] == [c["text"] for c in reference["choices"]]


def test_blocked_send_does_not_block_the_engine():
    """The server's ``send`` blocks after the first event, as when uvicorn pauses a transport whose
    client reads nothing: the engine still runs the request to its end, and serves others."""
    engine = FakeEngine(max_model_len=256)
    metrics = EngineMetrics(engine.model_name)
    llm = AsyncLLM(engine, stat_logger=metrics)
    app = build_app(llm, metrics)
    body = json.dumps({"prompt": "slow", "max_tokens": 50, "stream": True}).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "root_path": "", "query_string": b"",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
    }

    async def scenario():
        paused, first_event = asyncio.Event(), asyncio.Event()
        sent: list[bytes] = []
        requests = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if requests:
                return requests.pop()
            await asyncio.Event().wait()  # the client never hangs up

        async def send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                sent.append(message["body"])
                if len(sent) == 1:
                    first_event.set()
                else:
                    await paused.wait()  # the transport is paused: nothing more goes out

        task = asyncio.create_task(app(scope, receive, send))
        await asyncio.wait_for(first_event.wait(), 60)
        for _ in range(6000):
            if not engine.states and not llm._streams:
                break
            await asyncio.sleep(0.01)
        # The engine finished the request while its client has one event.
        assert not engine.states and not llm._streams and len(sent) == 2
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            other = await client.post("/v1/completions", json={"prompt": "other", "max_tokens": 5})
        assert other.status_code == 200 and other.json()["choices"][0]["text"] == "t0 t1 t2 t3 t4 "
        paused.set()
        await asyncio.wait_for(task, 60)
        return b"".join(sent).decode()

    try:
        stream = run(scenario())
    finally:
        llm.shutdown()
    result = StreamResult(200)
    for line in stream.splitlines():
        parse_sse_event(line, result, chat=False)
    assert result.done and result.texts[0] == "".join(f"t{j} " for j in range(50))
    assert result.finish_reasons == {0: "length"}
