"""Helpers for the reliability tests: instrumented servers, SSE clients, the pool-is-whole check."""
from __future__ import annotations

import asyncio
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx
from openai_server_utils import API_KEY, RemoteServer, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "SmolLM2-135M-Instruct"


class InstrumentedServer(RemoteServer):
    """``instrumented_server.py`` (the real server plus /debug/engine and fault hooks) in a child process."""

    def __init__(
        self, args: list[str], startup_timeout_s: float = 240.0, host_args: Optional[list[str]] = None, faults: bool = False
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="pagellm-reliability-", suffix=".log", delete=False)
        host_args = ["--host", "127.0.0.1"] if host_args is None else host_args
        cmd = [sys.executable, os.path.join(HERE, "instrumented_server.py"), *host_args, "--port", str(self.port), *args]
        self._launch(cmd, {"PAGELLM_TEST_FAULTS": "1" if faults else "0"}, startup_timeout_s)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def debug(self) -> dict[str, Any]:
        resp = httpx.get(f"{self.url}/debug/engine", timeout=30)
        resp.raise_for_status()
        return resp.json()

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=30).text

    def wait_idle(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Polls until the engine holds no request (aborts land asynchronously); returns the last snapshot."""
        deadline = time.monotonic() + timeout_s
        snap = self.debug()
        while time.monotonic() < deadline and not is_idle(snap):
            time.sleep(0.1)
            snap = self.debug()
        return snap

    def assert_pool_whole(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Every block back in the free queue (cached ones included), no reference or owner left."""
        snap = self.wait_idle(timeout_s)
        assert is_idle(snap), snap
        assert snap["num_free_blocks"] == snap["num_blocks"], snap
        assert snap["num_used_blocks"] == 0 and snap["num_referenced_blocks"] == 0, snap
        text = self.metrics()
        assert metric_value(text, "pagellm:kv_cache_usage_perc") == 0.0
        assert metric_value(text, "pagellm:num_requests_running") == 0.0
        assert metric_value(text, "pagellm:num_requests_waiting") == 0.0
        return snap


# Prompts of ~32 tokens and 16 new tokens take 3 blocks of 16 at the end: 256 such requests need
# ~770 blocks; 80 blocks hold about a tenth of them, so the scheduler must queue and preempt.
# The servers run the exact float32 path: the tests catch corruption by comparing each answer
# with the one its prompt gets alone, and a preempted request's recomputation sums its attention
# in another order, which int8 activations can round into another token.
MAIN_SERVER_ARGS = [
    "--dtype", "float32",
    "--num-kv-blocks", "80",
    "--max-num-seqs", "64",
    "--max-model-len", "96",
    "--no-enable-prefix-caching",
    "--max-request-body-bytes", str(256 << 10),
    "--api-key", API_KEY,
    "--disable-uvicorn-access-log",
]
CACHED_SERVER_ARGS = [
    "--dtype", "float32",
    "--num-kv-blocks", "96",
    "--max-num-seqs", "16",
    "--max-model-len", "128",
    "--max-waiting-requests", "16",
    "--api-key", API_KEY,
    "--disable-uvicorn-access-log",
]

LIVE_SERVERS: list[InstrumentedServer] = []  # checked after every test (see conftest)


def start_server(args: list[str], **kwargs) -> InstrumentedServer:
    server = InstrumentedServer(args, **kwargs)
    LIVE_SERVERS.append(server)
    return server


def is_idle(snap: dict[str, Any]) -> bool:
    return (
        snap["num_scheduler_requests"] == 0
        and snap["num_output_states"] == 0
        and snap["num_streams"] == 0
        and snap["num_block_owners"] == 0
    )


def metric_value(text: str, name: str) -> float:
    """The value of a sample; ``name`` may include its labels, e.g. ``x{finished_reason="abort",...}``."""
    if "{" in name:
        pattern = rf"^{re.escape(name)} ([0-9.e+-]+)$"
    else:
        pattern = rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$"
    match = re.search(pattern, text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def finished_count(text: str, reason: str) -> float:
    return metric_value(text, f'pagellm:request_success_total{{finished_reason="{reason}",model_name="{MODEL}"}}')


def assert_openai_error(resp: httpx.Response, status: Optional[int] = None) -> dict[str, Any]:
    """The body is exactly OpenAI's error shape, and its code matches the HTTP status."""
    if status is not None:
        assert resp.status_code == status, resp.text
    body = resp.json()
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"].endswith("Error"), err
    assert err["code"] == resp.status_code, err
    return err


@dataclass
class StreamResult:
    status: int
    texts: dict[int, str] = field(default_factory=dict)
    finish_reasons: dict[int, Optional[str]] = field(default_factory=dict)
    num_chunks: int = 0
    done: bool = False  # saw data: [DONE]
    errors: list[dict] = field(default_factory=list)  # in-band error events
    usage: Optional[dict] = None
    body: Optional[dict] = None  # the JSON error body when status != 200


def parse_sse_event(line: str, result: StreamResult, chat: bool) -> None:
    if not line.startswith("data: "):
        return
    data = line[len("data: ") :]
    if data == "[DONE]":
        result.done = True
        return
    event = json.loads(data)
    if "error" in event:
        result.errors.append(event["error"])
        return
    result.num_chunks += 1
    if event.get("usage"):
        result.usage = event["usage"]
    for choice in event.get("choices", []):
        i = choice["index"]
        text = (choice["delta"].get("content") or "") if chat else choice["text"]
        result.texts[i] = result.texts.get(i, "") + text
        if choice.get("finish_reason") is not None:
            result.finish_reasons[i] = choice["finish_reason"]


async def stream_request(
    client: httpx.AsyncClient, url: str, path: str, body: dict, headers: Optional[dict] = None
) -> StreamResult:
    """POSTs a streamed request and reads it to the end."""
    chat = path.endswith("chat/completions")
    async with client.stream("POST", url + path, json={**body, "stream": True}, headers=headers or AUTH) as resp:
        result = StreamResult(resp.status_code)
        if resp.status_code != 200:
            result.body = json.loads(await resp.aread())
            return result
        async for line in resp.aiter_lines():
            parse_sse_event(line, result, chat)
    return result


def run(coro):
    return asyncio.run(coro)
