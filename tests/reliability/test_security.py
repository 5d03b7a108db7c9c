"""Security: loopback by default, the API key on every /v1 route, tenants isolated in the prefix
cache, no request reading another's output, and no way for a request to choose what gets loaded."""
from __future__ import annotations

import asyncio
import inspect
import os
import random

import httpx
import pytest
from reliability_utils import API_KEY, AUTH, MODEL, assert_openai_error, run

from pagellm.entrypoints import server_state
from pagellm.entrypoints.dashboard import router as dashboard_router
from pagellm.entrypoints.openai import api_server

pytestmark = pytest.mark.slow


def listening_addresses(port: int) -> list[str]:
    """Local addresses of sockets listening on ``port``, from /proc/net/tcp{,6} (Linux)."""
    found = []
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(name):
            continue
        with open(name) as f:
            next(f)
            for line in f:
                local, state = line.split()[1], line.split()[3]
                address, port_hex = local.split(":")
                if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                    found.append(address)
    return found


def test_default_bind_is_loopback_only(cached_server):
    assert api_server.make_arg_parser().parse_args([]).host == "127.0.0.1"
    # cached_server was started without --host.
    if not os.path.exists("/proc/net/tcp"):
        pytest.skip("needs Linux /proc/net/tcp")
    assert listening_addresses(cached_server.port) == ["0100007F"]  # 127.0.0.1, and nothing else


def test_api_key_check_is_constant_time():
    # One check for every protected route: the key meets a candidate only inside compare_digest.
    source = inspect.getsource(server_state.authorize)
    assert source.count("hmac.compare_digest(") == 2 and " == " not in source and "!=" not in source
    guard = inspect.getsource(api_server.GuardMiddleware._authorized)
    assert "authorize(self.state, header)" in guard and "api_key" not in guard
    dashboard = inspect.getsource(dashboard_router.dashboard_router)
    assert "authorize(server_state," in dashboard and "api_key" not in dashboard


def test_every_v1_route_requires_the_key(cached_server):
    url = cached_server.url
    schema = httpx.get(f"{url}/openapi.json").json()
    routes = [(method.upper(), path) for path, ops in schema["paths"].items() if path.startswith("/v1") for method in ops]
    assert {("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")} <= set(routes)
    # Undeclared routes and methods under /v1 are refused before routing (no probing for routes).
    routes += [("GET", "/v1/nope"), ("POST", "/v1/models"), ("DELETE", "/v1/completions"), ("GET", "/v1")]
    wrong_keys = [
        None,
        "",
        "Bearer",
        "Bearer wrong",
        API_KEY,  # no scheme
        f"bearer {API_KEY}",
        f"Bearer  {API_KEY}",
        f"Bearer {API_KEY}x",
        f"Bearer {API_KEY[:-1]}",
        f"Basic {API_KEY}",
    ]
    body = {"model": MODEL, "prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for method, path in routes:
        for key in wrong_keys:
            headers = {} if key is None else {"Authorization": key}
            resp = httpx.request(method, f"{url}{path}", json=body, headers=headers, params={"api_key": API_KEY}, timeout=30)
            err = assert_openai_error(resp, 401)
            assert err["type"] == "AuthenticationError", (method, path, key)
        resp = httpx.request(method, f"{url}{path}", json=body, headers=AUTH, timeout=60)
        assert resp.status_code != 401, (method, path)
    # Probes and scrapes stay open (as vLLM's): they serve no model output.
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{url}{path}").status_code == 200


def cached_tokens(url: str, path: str, body: dict) -> int:
    resp = httpx.post(f"{url}{path}", json={"model": MODEL, "max_tokens": 1, **body}, headers=AUTH, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_cache_salt_keeps_tenants_apart(cached_server):
    url = cached_server.url
    system = "You are a careful assistant for the accounts team of a small bakery in Lyon. " * 2
    prompt = {"prompt": system + "Summarise the invoice from the flour supplier."}
    assert cached_tokens(url, "/v1/completions", prompt) == 0  # first sight of this prefix
    shared = cached_tokens(url, "/v1/completions", prompt)
    assert shared >= 32  # the unsalted prefix is reused by unsalted requests
    for tenant in ("tenant-a", "tenant-b"):
        assert cached_tokens(url, "/v1/completions", {**prompt, "cache_salt": tenant}) == 0, tenant
        assert cached_tokens(url, "/v1/completions", {**prompt, "cache_salt": tenant}) == shared, tenant
    assert cached_tokens(url, "/v1/completions", prompt) == shared  # and tenants never polluted it
    # Token-id prompts and chat messages are salted the same way.
    ids = httpx.post(f"{url}/tokenize", json={"prompt": prompt["prompt"]}, timeout=60).json()["tokens"]
    assert cached_tokens(url, "/v1/completions", {"prompt": ids, "cache_salt": "tenant-c"}) == 0
    assert cached_tokens(url, "/v1/completions", {"prompt": ids, "cache_salt": "tenant-c"}) == shared
    chat = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "What is owed?"}]}
    assert cached_tokens(url, "/v1/chat/completions", {**chat, "cache_salt": "tenant-a"}) == 0
    assert cached_tokens(url, "/v1/chat/completions", {**chat, "cache_salt": "tenant-a"}) >= 32
    assert cached_tokens(url, "/v1/chat/completions", {**chat, "cache_salt": "tenant-d"}) == 0


async def post_with_retry(client: httpx.AsyncClient, url: str, path: str, body: dict, rng: random.Random) -> httpx.Response:
    """A well-behaved client: on 503 it waits Retry-After (jittered) and tries again, a bounded number of times."""
    for _ in range(60):
        resp = await client.post(f"{url}{path}", json=body, headers=AUTH)
        if resp.status_code != 503:
            return resp
        await asyncio.sleep(float(resp.headers.get("retry-after", "1")) * rng.uniform(0.2, 1.0))
    return resp


def test_concurrent_requests_each_get_their_own_output(cached_server):
    """Distinct prompts behind one shared prefix (so blocks are shared), 48 at once: each answer is
    the one its prompt gets alone."""
    url = cached_server.url
    prefix = "Here are some facts about famous places around the world, one per line, for a school quiz.\n" * 2
    questions = [f"{i + 1}. The city known for {thing} is" for i, thing in enumerate(
        ["the Eiffel Tower", "the Colosseum", "Big Ben", "the Sagrada Familia", "the Golden Gate Bridge", "the Kremlin",
         "the Brandenburg Gate", "the Parthenon", "the Forbidden City", "the Opera House", "Times Square", "the Alhambra",
         "the canals", "the Little Mermaid statue", "the Space Needle", "the CN Tower"])]
    body = {"model": MODEL, "max_tokens": 12, "temperature": 0}
    alone = [
        httpx.post(f"{url}/v1/completions", json={**body, "prompt": prefix + q}, headers=AUTH, timeout=120).json()["choices"][0]["text"]
        for q in questions
    ]
    assert len(set(alone)) > len(alone) // 2  # the prompts really do get different answers

    async def together():
        rng = random.Random(5)
        async with httpx.AsyncClient(timeout=300) as client:
            jobs = []
            for i in range(48):
                q = questions[i % len(questions)]
                jobs.append(post_with_retry(client, url, "/v1/completions", {**body, "prompt": prefix + q, "n": 1 + i % 3}, rng))
            return await asyncio.gather(*jobs)

    for i, resp in enumerate(run(together())):
        assert resp.status_code == 200, resp.text
        texts = [c["text"] for c in resp.json()["choices"]]
        assert texts == [alone[i % len(questions)]] * (1 + i % 3), (i, texts)


def test_request_model_field_cannot_load_anything(cached_server):
    url = cached_server.url
    model_path = httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"][0]["root"]
    for name in [model_path, "/etc/passwd", "../../../../etc/passwd", "file:///etc/passwd", f"{MODEL}/../../etc",
                 "HuggingFaceTB/SmolLM2-360M-Instruct", "https://example.com/model.gguf", "\x00"]:
        for path, body in (
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/tokenize", {"prompt": "hi"}),
        ):
            err = assert_openai_error(httpx.post(f"{url}{path}", json={**body, "model": name}, headers=AUTH, timeout=30), 404)
            assert "does not exist" in err["message"] and err["param"] == "model"
    models = httpx.get(f"{url}/v1/models", headers=AUTH).json()["data"]
    assert [m["id"] for m in models] == [MODEL]
    assert cached_server.read_log().count("engine ready") == 1  # nothing else was ever loaded
