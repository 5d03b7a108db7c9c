"""LoRA adapters through the real server and the ``openai`` client: chosen by the ``model`` field,
listed at /v1/models, loaded and unloaded at run time behind the API key."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from lora_utils import ALL_TARGETS, write_random_adapter
from openai_server_utils import SERVER_ARGS, RemoteServer

pytestmark = pytest.mark.slow

BASE = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def adapter_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("server_adapters")
    return {
        "a1": write_random_adapter(root / "a1", 8, ALL_TARGETS, seed=11, std=0.05),
        "a2": write_random_adapter(root / "a2", 16, ["q_proj", "v_proj", "gate_proj"], seed=12, std=0.05),
    }


@pytest.fixture(scope="module")
def lora_server(adapter_paths):
    modules = ["a1=" + adapter_paths["a1"], json.dumps({"name": "a2", "path": adapter_paths["a2"], "base_model_name": BASE})]
    srv = RemoteServer(
        SERVER_ARGS + ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--lora-modules", *modules],
        env={"PAGELLM_ALLOW_RUNTIME_LORA_UPDATING": "1"},
    )
    yield srv
    srv.stop_and_check()


@pytest.fixture(scope="module")
def lora_client(lora_server):
    return lora_server.openai_client()


def _complete(client, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text


def test_models_lists_the_base_and_each_adapter(lora_client, adapter_paths):
    cards = {m.id: m for m in lora_client.models.list().data}
    assert list(cards) == [BASE, "a1", "a2"]
    for name in ("a1", "a2"):
        assert cards[name].model_extra["parent"] == BASE and cards[name].model_extra["root"] == adapter_paths[name]


def test_completions_and_chat_select_the_adapter_by_model(lora_client):
    base, a1, a2 = (_complete(lora_client, m) for m in (BASE, "a1", "a2"))
    assert len({base, a1, a2}) == 3
    assert _complete(lora_client, "a1") == a1  # deterministic, and the slot reuse keeps it so
    assert lora_client.completions.create(model="a1", prompt=PROMPT, max_tokens=1).model == "a1"
    messages = [{"role": "user", "content": "Name a color."}]
    chat = lambda model: lora_client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)  # noqa: E731
    assert chat("a2").choices[0].message.content != chat(BASE).choices[0].message.content


def test_unknown_model_is_404(lora_client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        _complete(lora_client, "no-such-adapter")


def test_load_and_unload_at_run_time(lora_server, lora_client, adapter_paths, auth_headers):
    url = lora_server.url
    body = {"lora_name": "a1-again", "lora_path": adapter_paths["a1"]}
    resp = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=auth_headers)
    assert resp.status_code == 200, resp.text
    assert "a1-again" in [m.id for m in lora_client.models.list().data]
    assert _complete(lora_client, "a1-again") == _complete(lora_client, "a1")
    again = httpx.post(f"{url}/v1/load_lora_adapter", json=body, headers=auth_headers)
    assert again.status_code == 400 and "already" in again.json()["error"]["message"]
    bad = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": "/nonexistent"}, headers=auth_headers)
    assert bad.status_code == 400 and "PEFT directory" in bad.json()["error"]["message"]
    assert "bad" not in [m.id for m in lora_client.models.list().data]
    resp = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a1-again"}, headers=auth_headers)
    assert resp.status_code == 200, resp.text
    with pytest.raises(openai.NotFoundError):
        _complete(lora_client, "a1-again")
    gone = httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "a1-again"}, headers=auth_headers)
    assert gone.status_code == 404


def test_adapter_routes_need_the_api_key(lora_server, adapter_paths):
    routes = [("load_lora_adapter", {"lora_name": "x", "lora_path": adapter_paths["a1"]}), ("unload_lora_adapter", {"lora_name": "a1"})]
    for route, body in routes:
        resp = httpx.post(f"{lora_server.url}/v1/{route}", json=body)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == 401
