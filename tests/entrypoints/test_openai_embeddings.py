"""``pagellm serve --runner pooling``: /v1/embeddings to the official ``openai`` client, against transformers.

One server per pooling type (LAST, MEAN, CLS) on the exact path (``--dtype float32``); each vector
is compared with transformers' last hidden state of the same weights, pooled the same way. The
default int8 path is checked offline (tests/engine/test_llm_embed.py), where an engine starts faster.
"""
from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import openai
import pytest
from hf_oracle import cosine, hf_embedding
from openai_server_utils import API_KEY, SERVER_ARGS, RemoteServer

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
TEXTS = ["The capital of France is Paris.", "Paged attention stores keys and values in fixed-size blocks.", "hi"]
TOKEN_IDS = [[29817, 19463, 4141, 1694, 288, 14799, 30], [504, 3458, 282, 4649, 314]]
EXACT_COSINE = 0.9999

SERVERS = {
    "LAST": ["--runner", "pooling", "--dtype", "float32"],
    "MEAN": ["--runner", "pooling", "--dtype", "float32", "--pooler-config", json.dumps({"pooling_type": "MEAN", "normalize": True})],
    "CLS": ["--task", "embed", "--dtype", "float32", "--pooler-config", json.dumps({"pooling_type": "CLS"})],
}


@pytest.fixture(scope="module", params=list(SERVERS))
def embed_server(request):
    # The LAST server runs with prefix caching, which LAST pooling keeps (the last token always runs).
    args = [a for a in SERVER_ARGS if a != "--no-enable-prefix-caching"] if request.param == "LAST" else SERVER_ARGS
    srv = RemoteServer([*args, *SERVERS[request.param], "--max-num-batched-tokens", "16"], use_cli=True)
    srv.kind = request.param
    yield srv
    srv.stop_and_check()


def only(*kinds: str):
    return pytest.mark.parametrize("embed_server", list(kinds), indirect=True)


def tokenize(server: RemoteServer, text: str) -> list[int]:
    resp = httpx.post(f"{server.url}/tokenize", json={"prompt": text}, headers={"Authorization": f"Bearer {API_KEY}"})
    return resp.json()["tokens"]


def test_matches_transformers_for_a_string_a_batch_and_token_ids(embed_server):
    client = embed_server.openai_client()
    bound, kind = EXACT_COSINE, embed_server.kind
    one = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert len(one.data) == 1 and one.data[0].index == 0 and one.data[0].object == "embedding"
    ids = tokenize(embed_server, TEXTS[0])
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(ids)
    assert cosine(one.data[0].embedding, hf_embedding(ids, kind)) >= bound
    # A batch longer than the 16-token step budget: prefilled in chunks, several requests per step.
    batch = client.embeddings.create(model=MODEL, input=TEXTS * 3, encoding_format="float")
    assert [d.index for d in batch.data] == list(range(len(TEXTS) * 3))
    all_ids = [tokenize(embed_server, t) for t in TEXTS]
    assert batch.usage.prompt_tokens == 3 * sum(len(i) for i in all_ids)
    for d in batch.data:
        ref = hf_embedding(all_ids[d.index % len(TEXTS)], kind)
        assert cosine(d.embedding, ref) >= bound, (d.index, kind)
        assert abs(np.linalg.norm(d.embedding) - 1.0) < 1e-4
    tokens = client.embeddings.create(model=MODEL, input=TOKEN_IDS, encoding_format="float")
    for d, ids in zip(tokens.data, TOKEN_IDS):
        assert cosine(d.embedding, hf_embedding(ids, kind)) >= bound
    single = client.embeddings.create(model=MODEL, input=TOKEN_IDS[0], encoding_format="float")
    assert cosine(single.data[0].embedding, tokens.data[0].embedding) >= 0.99999


@only("LAST")
def test_base64_equals_float_and_the_clients_default(embed_server):
    client = embed_server.openai_client()
    floats = client.embeddings.create(model=MODEL, input=TEXTS[:2], encoding_format="float")
    raw = httpx.post(
        f"{embed_server.url}/v1/embeddings",
        json={"model": MODEL, "input": TEXTS[:2], "encoding_format": "base64", "user": "someone"},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()
    assert raw["object"] == "list" and raw["model"] == MODEL
    for d, f in zip(raw["data"], floats.data):
        decoded = np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4")
        assert decoded.tolist() == f.embedding  # float32 values, bit for bit
    # The client asks for base64 by default and decodes it itself.
    default = client.embeddings.create(model=MODEL, input=TEXTS[:2])
    assert [d.embedding for d in default.data] == [f.embedding for f in floats.data]


@only("LAST")
def test_dimensions_truncate_then_renormalize(embed_server):
    client = embed_server.openai_client()
    ids = tokenize(embed_server, TEXTS[1])
    resp = client.embeddings.create(model=MODEL, input=TEXTS[1], dimensions=64, encoding_format="float")
    vec = resp.data[0].embedding
    assert len(vec) == 64 and abs(np.linalg.norm(vec) - 1.0) < 1e-5
    assert cosine(vec, hf_embedding(ids, "LAST", dimensions=64)) >= EXACT_COSINE
    raw = client.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float", extra_body={"normalize": False})
    ref = hf_embedding(ids, "LAST", normalize=False)
    assert np.allclose(raw.data[0].embedding, ref.numpy(), rtol=1e-3, atol=1e-3)


@only("LAST")
def test_a_prompt_seen_before_gives_the_same_vector_from_the_prefix_cache(embed_server):
    client = embed_server.openai_client()
    long_text = " ".join(TEXTS * 4)  # several full blocks, cached by the first request
    first, second = (client.embeddings.create(model=MODEL, input=long_text, encoding_format="float") for _ in range(2))
    assert cosine(first.data[0].embedding, second.data[0].embedding) >= 0.99999
    assert cosine(second.data[0].embedding, hf_embedding(tokenize(embed_server, long_text), "LAST")) >= EXACT_COSINE


@only("LAST")
def test_bad_requests_are_400_and_generation_routes_are_refused(embed_server):
    client = embed_server.openai_client()
    bad = [
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": 577}, "dimensions"),
        ({"input": [1] * 513}, None),  # past --max-model-len 512
        ({"input": []}, "input"),
        ({"input": [10**7]}, None),
        ({"input": "x", "encoding_format": "hex"}, None),
    ]
    for body, param in bad:
        with pytest.raises(openai.BadRequestError) as info:
            client.embeddings.create(model=MODEL, **body)
        assert info.value.status_code == 400, body
        if param is not None:
            assert info.value.body["param"] == param, body
    with pytest.raises(openai.BadRequestError, match="does not support Completions API"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="does not support Chat Completions API"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other-model", input="x")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{embed_server.url}/v1", api_key="wrong", max_retries=0).embeddings.create(model=MODEL, input="x")


@only("LAST")
def test_prompt_tokens_are_counted_in_metrics(embed_server):
    def prompt_tokens() -> float:
        text = httpx.get(f"{embed_server.url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).text
        line = next(row for row in text.splitlines() if row.startswith("pagellm:prompt_tokens_total"))
        return float(line.rsplit(" ", 1)[1])

    before = prompt_tokens()
    resp = embed_server.openai_client().embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert prompt_tokens() - before == resp.usage.prompt_tokens


@only("LAST")
def test_langchain_openai_embeddings_as_a_real_consumer(embed_server):
    from langchain_openai import OpenAIEmbeddings

    lc = OpenAIEmbeddings(model=MODEL, base_url=f"{embed_server.url}/v1", api_key=API_KEY, check_embedding_ctx_length=False, max_retries=0)
    docs = lc.embed_documents(TEXTS)
    query = lc.embed_query(TEXTS[0])
    direct = embed_server.openai_client().embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert len(docs) == len(TEXTS)
    for ours, theirs in zip(docs, direct.data):
        assert cosine(ours, theirs.embedding) >= 0.99999
    assert cosine(query, direct.data[0].embedding) >= 0.99999
