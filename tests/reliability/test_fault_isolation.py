"""A failure inside one request fails that request only; a failure of the engine loop fails fast.

Faults are injected by ``instrumented_server.py`` (keyed on the request's seed) or, in-process, by
monkeypatching the model runner of an offline ``LLM``.
"""
from __future__ import annotations

import asyncio

import httpx
import pytest
from instrumented_server import CRASH_SEED, FAIL_SEED
from openai_server_utils import HealthWatcher
from reliability_utils import AUTH, MAIN_SERVER_ARGS, MODEL, assert_openai_error, run, start_server, stream_request

pytestmark = pytest.mark.slow

PROMPTS = [f"Fact number {i} about the ocean is that" for i in range(8)]


def body(prompt: str, **extra) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **extra}


def test_sampling_failure_fails_only_that_request(main_server):
    url = main_server.url
    alone = [
        httpx.post(f"{url}/v1/completions", json=body(p), headers=AUTH, timeout=120).json()["choices"][0]["text"] for p in PROMPTS
    ]

    async def together():
        async with httpx.AsyncClient(timeout=300) as client:
            good = [
                stream_request(client, url, "/v1/completions", body(p))
                if i % 2
                else client.post(f"{url}/v1/completions", json=body(p), headers=AUTH)
                for i, p in enumerate(PROMPTS)
            ]
            bad_plain = client.post(f"{url}/v1/completions", json=body("Doomed", seed=FAIL_SEED, temperature=0.7), headers=AUTH)
            bad_stream = stream_request(client, url, "/v1/completions", body("Doomed too", seed=FAIL_SEED, n=2, temperature=0.7))
            bad_chat = client.post(
                f"{url}/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "seed": FAIL_SEED, "max_tokens": 5},
                headers=AUTH,
            )
            return await asyncio.gather(asyncio.gather(*good), bad_plain, bad_stream, bad_chat)

    good, bad_plain, bad_stream, bad_chat = run(together())
    for i, result in enumerate(good):
        text = result.texts[0] if i % 2 else result.json()["choices"][0]["text"]
        assert text == alone[i], (i, text, alone[i])
    for resp in (bad_plain, bad_chat):
        err = assert_openai_error(resp, 500)
        assert "sampling failed" in err["message"] and "injected sampling failure" in err["message"]
    # Streamed: the headers were out already, so the error comes in-band, then [DONE].
    assert bad_stream.status == 200 and bad_stream.done
    assert len(bad_stream.errors) == 1 and bad_stream.errors[0]["code"] == 500
    assert "injected sampling failure" in bad_stream.errors[0]["message"]
    assert httpx.get(f"{url}/health").status_code == 200
    text = httpx.post(f"{url}/v1/completions", json=body(PROMPTS[0]), headers=AUTH, timeout=120).json()["choices"][0]["text"]
    assert text == alone[0]


def test_untokenizable_strings_are_400_and_harmless(main_server):
    url = main_server.url
    lone_surrogate = b'"a\\udcffb"'
    for path, raw in [
        ("/v1/completions", b'{"prompt": ' + lone_surrogate + b', "max_tokens": 2}'),
        ("/v1/completions", b'{"prompt": ' + lone_surrogate + b', "max_tokens": 2, "stream": true}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": ' + lone_surrogate + b'}], "max_tokens": 2}'),
        ("/tokenize", b'{"prompt": ' + lone_surrogate + b"}"),
    ]:
        resp = httpx.post(f"{url}{path}", content=raw, headers={**AUTH, "content-type": "application/json"}, timeout=60)
        err = assert_openai_error(resp, 400)
        assert "tokenize" in err["message"]
    ok = httpx.post(f"{url}/v1/completions", json=body(PROMPTS[1]), headers=AUTH, timeout=120)
    assert ok.status_code == 200


def test_offline_llm_isolates_a_sampling_failure(monkeypatch):
    """In-process: the offline engine's sampler raises for one request of a batch."""
    from pagellm import LLM, SamplingParams
    from pagellm.worker.model_runner import ModelRunner

    llm = LLM(max_model_len=128, num_kv_blocks=32, enable_prefix_caching=False, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = [o.outputs[0].text for o in llm.generate(PROMPTS[:4], params, use_tqdm=False)]

    original = ModelRunner._sample_rows

    def failing(self, logits, rows, req_ids, result):
        if any(self.input_batch.params[r].seed == FAIL_SEED for r in rows.tolist()):
            raise RuntimeError("injected sampling failure")
        return original(self, logits, rows, req_ids, result)

    monkeypatch.setattr(ModelRunner, "_sample_rows", failing)
    doomed = SamplingParams(temperature=0.5, seed=FAIL_SEED, max_tokens=8)
    outputs = llm.generate(PROMPTS[:2] + ["Doomed"] + PROMPTS[2:4], [params, params, doomed, params, params], use_tqdm=False)
    assert [o.outputs[0].text for o in outputs[:2] + outputs[3:]] == alone
    assert outputs[2].outputs[0].finish_reason == "error" and "injected sampling failure" in outputs[2].error
    kv = llm.llm_engine.core.kv_cache_manager
    kv.check_integrity()
    assert kv.block_pool.num_used_blocks == 0 and not kv.req_to_blocks
    assert not llm.llm_engine.has_unfinished_requests()


def test_engine_crash_fails_in_flight_requests_and_exits_nonzero():
    server = start_server([a for a in MAIN_SERVER_ARGS if a != "--no-enable-prefix-caching"], faults=True)
    url = server.url

    async def scenario():
        async with httpx.AsyncClient(timeout=300) as client:
            long = {"model": MODEL, "max_tokens": 60, "ignore_eos": True}
            streams = [
                asyncio.ensure_future(stream_request(client, url, "/v1/completions", {**long, "prompt": f"Stream {i} says"}))
                for i in range(3)
            ]
            plain = asyncio.ensure_future(client.post(f"{url}/v1/completions", json={**long, "prompt": "Plain"}, headers=AUTH))
            for _ in range(600):  # until all are running
                if server.debug()["num_running"] >= 4:
                    break
                await asyncio.sleep(0.05)
            crash = await client.post(
                f"{url}/v1/completions", json={"model": MODEL, "prompt": "boom", "max_tokens": 4, "seed": CRASH_SEED}, headers=AUTH
            )
            return crash, await plain, await asyncio.gather(*streams)

    health = HealthWatcher(server).start()
    try:
        crash, plain, streams = run(scenario())
        code = server.proc.wait(60)
    finally:
        health.stop()
        server.kill()
    log = server.read_log()
    server.cleanup()
    for resp in (crash, plain):
        err = assert_openai_error(resp, 503)
        assert "crashed" in err["message"] and "injected engine failure" in err["message"]
    for result in streams:
        # Each stream was cut with an error event and a clean end, not left hanging.
        assert result.status == 200 and result.done, result
        assert len(result.errors) == 1 and result.errors[0]["code"] == 503 and "crashed" in result.errors[0]["message"]
    assert 503 in health.statuses and health.statuses[0] == 200, health.statuses
    assert code == 1, log
    assert "the engine loop crashed" in log
