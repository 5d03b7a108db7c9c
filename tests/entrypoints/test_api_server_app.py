"""The FastAPI app in-process on a model-free engine: routes, response shapes, every error class."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest
from fake_engine import FakeEngine

from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.metrics import EngineMetrics
from pagellm.entrypoints.openai.api_server import GracefulServer, build_app
from pagellm.entrypoints.server_state import ServerState

API_KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture
def server():
    engine = FakeEngine(max_model_len=64, max_waiting_requests=4)
    metrics = EngineMetrics(engine.model_name)
    llm = AsyncLLM(engine, stat_logger=metrics)
    app = build_app(llm, metrics, api_key=API_KEY, max_request_body_bytes=4096)
    yield app, llm
    llm.shutdown()


def request(app, method: str, path: str, **kwargs) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def assert_error(resp: httpx.Response, status: int, error_type: str, match: str = "") -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == error_type and err["code"] == status
    assert match.lower() in err["message"].lower()
    return err


def test_health_version_models(server):
    app, _ = server
    assert request(app, "GET", "/health").status_code == 200
    assert request(app, "GET", "/version").json() == {"version": "0.1.0"}
    models = request(app, "GET", "/v1/models", headers=AUTH).json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "fake-model" and models["data"][0]["max_model_len"] == 64


def test_completion_shape_and_usage(server):
    app, _ = server
    resp = request(app, "POST", "/v1/completions", headers=AUTH, json={"prompt": "abc", "max_tokens": 3, "n": 2})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == "fake-model"
    assert isinstance(body["created"], int)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["text"] == "t0 t1 t2 " and c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 6,
        "total_tokens": 9,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_completion_batch_of_prompts_and_token_ids(server):
    app, _ = server
    resp = request(app, "POST", "/v1/completions", headers=AUTH, json={"prompt": [[1, 2], [3, 4, 5]], "max_tokens": 2})
    body = resp.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 4
    resp = request(app, "POST", "/v1/completions", headers=AUTH, json={"prompt": ["a", "bc"], "max_tokens": 1, "echo": True})
    assert [c["text"] for c in resp.json()["choices"]] == ["at0 ", "bct0 "]


def test_streamed_completion_ends_with_done_and_usage(server):
    app, _ = server
    body = {"prompt": "abc", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    resp = request(app, "POST", "/v1/completions", headers=AUTH, json=body)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: ") :] for line in resp.text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "t0 t1 t2 "
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert all(c["usage"] is None for c in chunks[:-1])


def test_bad_requests_are_400_in_openai_shape(server):
    app, _ = server
    post = lambda **kw: request(app, "POST", "/v1/completions", headers={**AUTH, **kw.pop("headers", {})}, **kw)  # noqa: E731
    json_type = {"content-type": "application/json"}
    assert_error(post(content=b'{"prompt": "x",', headers=json_type), 400, "BadRequestError", "not valid JSON")
    assert_error(post(content=b'{"prompt": "x"}'), 400, "BadRequestError", "JSON object")
    assert_error(post(content=b"[1, 2]", headers=json_type), 400, "BadRequestError", "JSON object")
    assert_error(post(content=b"", headers=json_type), 400, "BadRequestError")
    err = assert_error(post(json={"prompt": "x", "temperature": "hot"}), 400, "BadRequestError", "temperature")
    assert err["param"] == "temperature"
    assert_error(post(json={"max_tokens": 3}), 400, "BadRequestError", "prompt")
    assert_error(post(json={"prompt": "x", "n": 0}), 400, "BadRequestError", "n must be")
    assert_error(post(json={"prompt": "x", "top_p": 7}), 400, "BadRequestError", "top_p")
    assert_error(post(json={"prompt": "x", "max_tokens": 1000}), 400, "BadRequestError", "max_model_len")
    assert_error(post(json={"prompt": "bad"}), 400, "BadRequestError", "not allowed")
    assert_error(post(json={"prompt": []}), 400, "BadRequestError", "empty")
    assert_error(post(json={"prompt": "x", "logit_bias": {"abc": 1}}), 400, "BadRequestError", "logit_bias")
    assert_error(post(json={"prompt": "x", "logit_bias": {"1000": 1}}), 400, "BadRequestError", "vocabulary")
    assert_error(post(json={"prompt": "x", "stream_options": {"include_usage": True}}), 400, "BadRequestError", "stream")
    assert_error(post(json={"prompt": "x", "suffix": "y"}), 400, "BadRequestError", "suffix")
    chat = request(app, "POST", "/v1/chat/completions", headers=AUTH, json={"messages": [{"role": "user", "content": "hi"}]})
    assert_error(chat, 400, "BadRequestError", "chat template")
    chat = request(app, "POST", "/v1/chat/completions", headers=AUTH, json={"messages": [{"content": "hi"}]})
    assert_error(chat, 400, "BadRequestError", "role")
    for role in ("robot", "User", ""):
        chat = request(app, "POST", "/v1/chat/completions", headers=AUTH, json={"messages": [{"role": role, "content": "hi"}]})
        err = assert_error(chat, 400, "BadRequestError", "unknown role")
        assert err["param"] == "messages"
    tok = request(app, "POST", "/tokenize", headers=AUTH, json={"messages": [{"role": "bot", "content": "hi"}]})
    assert_error(tok, 400, "BadRequestError", "unknown role")
    # And the server still serves.
    assert post(json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_unknown_model_and_route_are_404(server):
    app, _ = server
    err = assert_error(
        request(app, "POST", "/v1/completions", headers=AUTH, json={"prompt": "x", "model": "gpt-5"}), 404, "NotFoundError", "gpt-5"
    )
    assert err["param"] == "model"
    assert_error(request(app, "GET", "/v1/nothing", headers=AUTH), 404, "NotFoundError")


def test_api_key_guards_v1_only(server):
    app, _ = server
    assert_error(request(app, "GET", "/v1/models"), 401, "AuthenticationError")
    assert_error(request(app, "GET", "/v1/models", headers={"Authorization": "Bearer wrong"}), 401, "AuthenticationError")
    assert_error(request(app, "POST", "/v1/completions", json={"prompt": "x"}), 401, "AuthenticationError")
    assert request(app, "GET", "/v1/models", headers=AUTH).status_code == 200
    assert request(app, "GET", "/health").status_code == 200
    assert request(app, "POST", "/tokenize", json={"prompt": "ab"}).json()["tokens"] == [97, 98]


def test_body_too_large_is_413(server):
    app, _ = server
    resp = request(app, "POST", "/v1/completions", headers=AUTH, json={"prompt": "x" * 10_000})
    assert_error(resp, 413, "RequestEntityTooLargeError", "limit")
    assert request(app, "POST", "/v1/completions", headers=AUTH, json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_tokenize_and_detokenize(server):
    app, _ = server
    body = request(app, "POST", "/tokenize", json={"prompt": "hi", "return_token_strs": True}).json()
    assert body == {"count": 2, "max_model_len": 64, "tokens": [104, 105], "token_strs": ["h", "i"]}
    assert request(app, "POST", "/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}
    assert_error(request(app, "POST", "/detokenize", json={"tokens": [5000]}), 400, "BadRequestError", "range")
    assert_error(request(app, "POST", "/tokenize", json={}), 400, "BadRequestError", "exactly one")


def test_overloaded_is_503_with_retry_after(server):
    app, llm = server
    llm._num_waiting = 4  # as if the scheduler's queue were full
    resp = request(app, "POST", "/v1/completions", headers=AUTH, json={"prompt": "x"})
    assert_error(resp, 503, "ServiceUnavailableError", "overloaded")
    assert resp.headers["retry-after"] == "1"
    llm._num_waiting = 0
    assert request(app, "POST", "/v1/completions", headers=AUTH, json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_dead_engine_makes_health_503(server):
    app, llm = server
    llm.engine.crash_on_step = 1
    resp = request(app, "POST", "/v1/completions", headers=AUTH, json={"prompt": "x", "max_tokens": 5})
    assert_error(resp, 503, "ServiceUnavailableError", "crashed")
    assert llm.is_dead
    assert_error(request(app, "GET", "/health"), 503, "ServiceUnavailableError", "dead")
    assert_error(request(app, "POST", "/v1/completions", headers=AUTH, json={"prompt": "x"}), 503, "ServiceUnavailableError")


def test_draining_refuses_new_requests(server):
    app, _ = server
    app.state.server.draining = True
    resp = request(app, "POST", "/v1/completions", headers=AUTH, json={"prompt": "x"})
    assert_error(resp, 503, "ServiceUnavailableError", "shutting down")
    assert request(app, "GET", "/metrics").status_code == 200


def test_metrics_exposition(server):
    app, _ = server
    request(app, "POST", "/v1/completions", headers=AUTH, json={"prompt": "abc", "max_tokens": 3})
    text = request(app, "GET", "/metrics").text
    assert 'pagellm:generation_tokens_total{model_name="fake-model"} 3.0' in text
    assert 'pagellm:prompt_tokens_total{model_name="fake-model"} 3.0' in text
    assert 'pagellm:request_success_total{finished_reason="length",model_name="fake-model"} 1.0' in text
    for name in (
        "pagellm:time_to_first_token_seconds_count",
        "pagellm:inter_token_latency_seconds_count",
        "pagellm:e2e_request_latency_seconds_count",
        "pagellm:request_queue_time_seconds_count",
    ):
        assert f'{name}{{model_name="fake-model"}} ' in text
    assert 'pagellm:request_queue_time_seconds_count{model_name="fake-model"} 1.0' in text


class _StubLLM:
    def __init__(self) -> None:
        self.is_dead = False
        self.num_abort_all = 0

    def abort_all(self) -> None:
        self.num_abort_all += 1


def make_graceful_server(shutdown_timeout: float = 10.0):
    import uvicorn

    state, llm = ServerState(), _StubLLM()
    return GracefulServer(uvicorn.Config(app=None), state, llm, shutdown_timeout), state, llm


def test_sigterm_drains_until_requests_finish():
    server, state, llm = make_graceful_server()
    state.num_in_flight = 2
    assert asyncio.run(server.on_tick(1)) is False
    server.handle_exit(signal.SIGTERM, None)
    assert state.draining and not server.should_exit
    assert asyncio.run(server.on_tick(1)) is False  # still two in flight
    state.num_in_flight = 0
    assert asyncio.run(server.on_tick(1)) is True
    assert server._captured_signals == []  # not re-raised after shutdown: the exit code stays 0
    assert llm.num_abort_all == 0


def test_shutdown_timeout_aborts_the_rest():
    server, state, llm = make_graceful_server(shutdown_timeout=0.0)
    state.num_in_flight = 1
    server.handle_exit(signal.SIGTERM, None)
    assert asyncio.run(server.on_tick(1)) is False
    assert llm.num_abort_all == 1
    server._aborted_at = time.monotonic() - 3  # their final chunks had time to go out
    assert asyncio.run(server.on_tick(1)) is True
    server.handle_exit(signal.SIGINT, None)  # a second signal forces the exit
    assert server.force_exit


def test_dead_engine_stops_the_server():
    server, _, llm = make_graceful_server()
    assert asyncio.run(server.on_tick(1)) is False
    llm.is_dead = True
    assert asyncio.run(server.on_tick(1)) is False  # a moment for errors to reach clients
    server._dead_since = time.monotonic() - 2
    assert asyncio.run(server.on_tick(1)) is True


def test_runtime_lora_routes_are_opt_in(monkeypatch):
    """As vLLM: load/unload (a client naming a directory to read) exist only with the env switch."""
    engine = FakeEngine(max_model_len=64)
    metrics = EngineMetrics(engine.model_name)
    llm = AsyncLLM(engine, stat_logger=metrics)
    try:
        app = build_app(llm, metrics, api_key=API_KEY)
        body = {"lora_name": "x", "lora_path": "/etc"}
        assert request(app, "POST", "/v1/load_lora_adapter", json=body, headers=AUTH).status_code == 404
        monkeypatch.setenv("PAGELLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
        app = build_app(llm, metrics, api_key=API_KEY, lora_modules=["a=/adapters/a"])
        paths = {getattr(route, "path", None) for route in app.routes}
        assert {"/v1/load_lora_adapter", "/v1/unload_lora_adapter"} <= paths
        assert request(app, "POST", "/v1/unload_lora_adapter", json={"lora_name": "nope"}, headers=AUTH).status_code == 404
        models = request(app, "GET", "/v1/models", headers=AUTH).json()["data"]
        assert [(m["id"], m["parent"], m["root"]) for m in models][1:] == [("a", engine.model_name, "/adapters/a")]
    finally:
        llm.shutdown()
