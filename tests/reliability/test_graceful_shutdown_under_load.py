"""SIGTERM under load (extends tests/entrypoints/test_server_lifecycle.py's two-request drain):
no new request is admitted, the in-flight streams finish or end cleanly with ``abort`` and
``[DONE]`` within ``--shutdown-timeout``, and the process exits 0."""
from __future__ import annotations

import asyncio
import signal

import httpx
import pytest
from reliability_utils import AUTH, MAIN_SERVER_ARGS, MODEL, StreamResult, parse_sse_event, run, start_server

pytestmark = pytest.mark.slow


def test_sigterm_under_load_drains_and_exits_zero():
    server = start_server(MAIN_SERVER_ARGS + ["--shutdown-timeout", "3"])
    url = server.url
    num_clients = 24

    async def scenario():
        started = [asyncio.Event() for _ in range(num_clients)]

        async def client_stream(client: httpx.AsyncClient, i: int) -> StreamResult:
            short = i % 2 == 0
            body = {"model": MODEL, "prompt": f"Client {i} counts slowly:", "max_tokens": 6 if short else 80,
                    "ignore_eos": True, "temperature": 0, "stream": True}
            async with client.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as resp:
                result = StreamResult(resp.status_code)
                async for line in resp.aiter_lines():
                    parse_sse_event(line, result, chat=False)
                    if result.num_chunks:
                        started[i].set()
            started[i].set()
            return result

        async with httpx.AsyncClient(timeout=180, limits=httpx.Limits(max_connections=64)) as client:
            tasks = [asyncio.ensure_future(client_stream(client, i)) for i in range(num_clients)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            refused = []
            for _ in range(10):  # new arrivals during the drain
                try:
                    async with httpx.AsyncClient(timeout=30) as fresh:
                        resp = await fresh.post(
                            f"{url}/v1/completions", json={"model": MODEL, "prompt": "late", "max_tokens": 2}, headers=AUTH
                        )
                    refused.append(resp.status_code)
                    assert resp.status_code == 503 and "shutting down" in resp.json()["error"]["message"], resp.text
                    assert resp.headers["retry-after"]
                except httpx.TransportError:
                    refused.append("closed")  # the listener is gone: also a refusal
                await asyncio.sleep(0.2)
            return await asyncio.gather(*tasks), refused

    try:
        results, refused = run(scenario())
        code = server.proc.wait(60)
    finally:
        server.kill()
    log = server.read_log()
    server.cleanup()
    assert 200 not in refused and len(refused) == 10
    reasons = []
    for i, result in enumerate(results):
        assert result.status == 200 and result.done and not result.errors, (i, result)
        reasons.append(result.finish_reasons[0])
        if i % 2 == 0:
            assert result.finish_reasons == {0: "length"}, (i, result)  # short ones finished normally
        else:
            assert result.finish_reasons[0] in ("length", "abort"), (i, result)
    assert code == 0, log
    assert "received SIGTERM" in log
    print("finish reasons of the in-flight streams:", {r: reasons.count(r) for r in set(reasons)}, "late arrivals:", refused)
