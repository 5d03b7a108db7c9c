"""The HTTP side of ``bench serve`` against a fake OpenAI server (httpx mock transport)."""
import asyncio
import json

import httpx
import pytest

from pagellm.bench.datasets import SampleRequest
from pagellm.bench.metrics import calculate_metrics
from pagellm.bench.serve import arrival_offsets, benchmark, completion_payload


class FakeServer:
    """Streams one chunk per token, then a usage chunk, as an OpenAI completions server does."""

    def __init__(self, fail_prompts=(), report_usage=True, sse_comments=False, in_band_error_prompts=(), token_text="t{i} "):
        self.payloads = []
        self.token_text = token_text
        self.in_band_error_prompts = set(in_band_error_prompts)
        self.fail_prompts = set(fail_prompts)
        self.report_usage = report_usage
        self.sse_comments = sse_comments

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny-model", "object": "model"}]})
        assert request.url.path == "/v1/completions"
        payload = json.loads(request.content)
        self.payloads.append(payload)
        prompt = payload["prompt"]
        key = prompt[0] if isinstance(prompt, list) else prompt
        if key in self.fail_prompts:
            return httpx.Response(500, text="boom")
        events = []
        if self.sse_comments:
            events.append(": keep-alive\n\n")
        for i in range(payload["max_tokens"]):
            if key in self.in_band_error_prompts and i == 1:
                events.append("data: " + json.dumps({"error": {"message": "engine died", "code": 500}}) + "\n\n")
                break
            chunk = {"id": "c", "choices": [{"index": 0, "text": self.token_text.format(i=i)}]}
            events.append("data: " + json.dumps(chunk, ensure_ascii=False) + "\r\n\r\n")
        if self.report_usage:
            usage = {"prompt_tokens": 3, "completion_tokens": payload["max_tokens"], "total_tokens": 3 + payload["max_tokens"]}
            events.append("data: " + json.dumps({"id": "c", "choices": [], "usage": usage}) + "\n\n")
        events.append("data: [DONE]\n\n")
        return httpx.Response(200, content="".join(events).encode(), headers={"content-type": "text/event-stream"})


SAMPLES = [SampleRequest([11, 12, 13], 4), SampleRequest([21, 22], 1), SampleRequest([31, 32, 33, 34], 3)]
PROMPTS = [s.prompt_token_ids for s in SAMPLES]


def run(server, **kwargs):
    return asyncio.run(
        benchmark("http://fake:8000/", PROMPTS, SAMPLES, transport=httpx.MockTransport(server), disable_tqdm=True, **kwargs)
    )


def test_streams_every_request_with_ignore_eos_and_exact_lengths():
    server = FakeServer(sse_comments=True)
    traces, duration, model = run(server, max_concurrency=2)
    assert model == "tiny-model"  # first of /v1/models
    assert duration > 0
    probe, *sent = server.payloads
    assert probe["max_tokens"] == 1  # the test request
    assert sorted(p["prompt"][0] for p in sent) == [11, 21, 31]
    for p in sent:
        assert p["ignore_eos"] is True and p["stream"] is True and p["model"] == "tiny-model"
        assert p["stream_options"] == {"include_usage": True}
        assert "temperature" not in p
    assert [t.success for t in traces] == [True, True, True]
    assert [t.output_len for t in traces] == [4, 1, 3]
    assert [len(t.itl) for t in traces] == [3, 0, 2]  # one gap per chunk after the first
    assert [t.prompt_len for t in traces] == [3, 2, 4]
    assert traces[0].generated_text == "t0 t1 t2 t3 "
    assert all(t.latency >= t.ttft >= 0 for t in traces)
    m = calculate_metrics(traces, duration)
    assert (m.completed, m.failed, m.total_output, m.total_input) == (3, 0, 8, 9)


def test_text_with_unicode_line_breaks_stays_in_its_chunk():
    # JSON leaves U+0085 / U+2028 / U+2029 raw; only CR and LF end an event-stream line.
    server = FakeServer(token_text="a\u2028b\x85c\u2029{i}")
    traces, duration, _ = run(server)
    assert [t.success for t in traces] == [True, True, True], [t.error for t in traces]
    assert traces[1].generated_text == "a\u2028b\x85c\u20290"
    assert calculate_metrics(traces, duration).total_output == 8


def test_without_usage_counts_chunks_and_failures_are_reported():
    server = FakeServer(fail_prompts={21}, report_usage=False)
    traces, duration, _ = run(server, model="named-model")
    assert all(p["model"] == "named-model" for p in server.payloads)
    assert [t.success for t in traces] == [True, False, True]
    assert "HTTP 500" in traces[1].error and "boom" in traces[1].error
    assert [t.output_len for t in traces] == [4, 0, 3]
    m = calculate_metrics(traces, duration)
    assert (m.completed, m.failed, m.total_output) == (2, 1, 7)


def test_in_band_stream_error_fails_the_request():
    traces, duration, _ = run(FakeServer(in_band_error_prompts={31}))
    assert [t.success for t in traces] == [True, True, False]
    assert "engine died" in traces[2].error


def test_failing_test_request_is_a_clear_error():
    with pytest.raises(ValueError, match="test request"):
        run(FakeServer(fail_prompts={11}))


def test_payload_with_temperature_and_text_prompt():
    p = completion_payload("m", "hello", 5, temperature=0.0)
    assert p["prompt"] == "hello" and p["max_tokens"] == 5 and p["temperature"] == 0.0 and p["ignore_eos"] is True


def test_arrival_offsets():
    assert arrival_offsets(4, float("inf")) == [0.0] * 4
    offsets = arrival_offsets(50, request_rate=5.0, seed=1)
    assert offsets == arrival_offsets(50, request_rate=5.0, seed=1)
    assert offsets != arrival_offsets(50, request_rate=5.0, seed=2)
    assert all(b >= a for a, b in zip(offsets, offsets[1:]))
    assert offsets[-1] == pytest.approx(50 / 5.0)  # rescaled so the total matches the rate
    bursty = arrival_offsets(50, request_rate=5.0, burstiness=0.2, seed=1)
    assert bursty[-1] == pytest.approx(10.0)
    for bad in (dict(request_rate=0.0), dict(request_rate=1.0, burstiness=0.0)):
        with pytest.raises(ValueError):
            arrival_offsets(3, **bad)
