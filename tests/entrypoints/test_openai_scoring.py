"""Completions ``echo`` + ``logprobs`` + ``max_tokens=0``: prompt scoring, as lm-eval's loglikelihood uses it.

The server runs with prefix caching on and a tiny token budget (chunked prefill), so scores are
checked under both; each equals transformers' float32 log-probability within
``hf_oracle.logprob_close``'s tolerance.
"""
from __future__ import annotations

import json
import random

import httpx
import pytest
import torch
from hf_oracle import hf_model_and_tokenizer, logprob_close
from openai_server_utils import API_KEY, RemoteServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CONTEXTS = [
    "The capital of France is", "Water boils at a temperature of", "The quick brown fox jumps over the",
    "In 1492, Columbus sailed", "def square(x):\n    return", "The largest planet in our solar system is",
    "Roses are red, violets are", "She opened the door and saw", "2 + 2 =", "The chemical symbol for gold is",
]
CONTINUATIONS = [" Paris.", " blue", " 100 degrees Celsius.", " the lazy dog"]


@pytest.fixture(scope="module")
def server():
    # The exact path: scores are compared with transformers' float32 ones.
    args = ["--dtype", "float32", "--max-model-len", "512", "--kv-cache-memory", "48MiB", "--max-num-batched-tokens", "16",
            "--api-key", API_KEY, "--disable-uvicorn-access-log"]
    srv = RemoteServer(args)
    yield srv
    srv.terminate()
    srv.cleanup()


def pairs() -> list[tuple[list[int], list[int]]]:
    _, tok = hf_model_and_tokenizer()
    rng = random.Random(0)
    out = []
    for ctx in CONTEXTS:
        for cont in rng.sample(CONTINUATIONS, 2):
            out.append((tok.encode(ctx), tok.encode(cont)))
    return out


@torch.inference_mode()
def hf_token_logprobs(ids: list[int]) -> list[float]:
    model, _ = hf_model_and_tokenizer()
    logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def score(server, prompt, **extra) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0, **extra}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_loglikelihoods_equal_transformers(server):
    items = pairs()
    assert len(items) == 20
    # Twice: the second round finds every context's blocks in the prefix cache.
    for _ in range(2):
        resp = score(server, [ctx + cont for ctx, cont in items])
        for (ctx, cont), choice in zip(items, resp["choices"]):
            ids = ctx + cont
            lp = choice["logprobs"]
            assert choice["finish_reason"] == "length"
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == len(ids)
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            ref = hf_token_logprobs(ids)
            for ours, theirs in zip(lp["token_logprobs"][1:], ref):
                assert logprob_close(ours, theirs), (ours, theirs)
            ll = sum(lp["token_logprobs"][len(ctx):])
            assert logprob_close(ll, sum(ref[len(ctx) - 1:])), ll
            # text_offset indexes the echoed text.
            assert choice["text"] == "".join(lp["tokens"])
            assert all(choice["text"][o:].startswith(t) for o, t in zip(lp["text_offset"], lp["tokens"]))
            assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"][1:])
        assert resp["usage"]["completion_tokens"] == 0


def test_echo_text_prompt_streamed_and_validation(server):
    full = score(server, "Hello there, general")
    chunks = []
    body = {"model": MODEL, "prompt": "Hello there, general", "max_tokens": 0, "echo": True, "logprobs": 1, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", headers=AUTH, timeout=120, json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == full["choices"][0]["text"] == "Hello there, general"
    streamed = [x for c in chunks if c["choices"] and c["choices"][0]["logprobs"] for x in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == full["choices"][0]["logprobs"]["token_logprobs"]
    bad = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 0}, headers=AUTH, timeout=30)
    assert bad.status_code == 400 and "echo" in bad.json()["error"]["message"]
    # prompt_logprobs (vLLM's extra) without echo: the generated text plus the prompt's scores.
    resp = httpx.post(f"{server.url}/v1/completions", headers=AUTH, timeout=60,
                      json={"prompt": "Hello there", "max_tokens": 2, "temperature": 0, "logprobs": 0, "echo": True})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2
