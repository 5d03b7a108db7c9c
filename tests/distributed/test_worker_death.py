"""A tensor-parallel rank that dies fails the engine cleanly and fast: never a hang.

Offline, the step that was waiting raises ``WorkerDiedError`` and the other rank is killed. Behind
the server, in-flight requests end with an error, /health answers 503 and the server exits 1.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
from openai_server_utils import API_KEY, HealthWatcher, RemoteServer

from pagellm import LLM, SamplingParams
from pagellm.executor.base import WorkerDiedError

pytestmark = pytest.mark.slow

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _rank_pids(parent: int) -> list[int]:
    """The spawned rank processes of ``parent`` (not multiprocessing's resource tracker), by start order."""
    pids = []
    for task in os.listdir(f"/proc/{parent}/task"):
        with open(f"/proc/{parent}/task/{task}/children") as f:
            pids += [int(p) for p in f.read().split()]
    ranks = []
    for pid in sorted(pids):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"spawn_main" in f.read():
                    ranks.append(pid)
        except FileNotFoundError:
            pass
    return ranks


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] == "Z"
    except FileNotFoundError:
        return True


def test_killed_rank_fails_the_step_offline():
    llm = LLM(tensor_parallel_size=2, num_kv_blocks=256, max_num_seqs=8, max_model_len=512)
    engine = llm.llm_engine
    pids = engine.core.executor.worker_pids
    for i in range(4):
        engine.add_request(str(i), f"Story {i}:", SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        llm._step_thread.submit(engine.step).result()
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank"):
        for _ in range(1000):
            llm._step_thread.submit(engine.step).result()
    assert time.monotonic() - t0 < 10
    with pytest.raises(WorkerDiedError):  # and it stays failed
        engine.step()
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids)
    llm.shutdown()


def test_killed_rank_mid_stream_fails_requests_503_and_exit_1():
    server = RemoteServer(
        ["--tensor-parallel-size", "2", "--num-kv-blocks", "256", "--max-model-len", "512", "--api-key", API_KEY], use_cli=True
    )
    url = server.url

    async def stream(client: httpx.AsyncClient, i: int, first: asyncio.Event) -> tuple[int, list[str]]:
        body = {"prompt": f"Stream {i} says", "max_tokens": 400, "ignore_eos": True, "stream": True}
        lines = []
        async with client.stream("POST", f"{url}/v1/completions", json=body, headers=AUTH) as resp:
            async for line in resp.aiter_lines():
                lines.append(line)
                if resp.status_code == 200 and line.startswith("data:"):
                    first.set()
            return resp.status_code, lines

    ranks: list[int] = []

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as client:
            first = asyncio.Event()
            tasks = [asyncio.ensure_future(stream(client, i, first)) for i in range(3)]
            await asyncio.wait_for(first.wait(), 120)
            ranks.extend(_rank_pids(server.proc.pid))
            assert len(ranks) == 2, ranks
            t0 = time.monotonic()
            os.kill(ranks[1], signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 10)
            return results, time.monotonic() - t0

    health = HealthWatcher(server).start()
    try:
        results, elapsed = asyncio.run(scenario())
        t0 = time.monotonic()
        code = server.proc.wait(10)
        exit_s = time.monotonic() - t0
    finally:
        health.stop()
        log = server.read_log()
        server.cleanup()
    assert elapsed < 10
    for status, lines in results:
        # Streaming already: the error arrives in-band, then the stream ends. A request the engine
        # had not yet accepted when the rank died is refused with a 503 instead.
        assert status in (200, 503), (status, lines[-3:])
        assert any('"error"' in line and "rank" in line for line in lines), (status, lines[-3:])
    assert code == 1, log
    assert exit_s + elapsed < 10
    assert health.statuses and health.statuses[0] == 200 and 503 in health.statuses, health.statuses
    assert all(_gone(p) for p in ranks)
