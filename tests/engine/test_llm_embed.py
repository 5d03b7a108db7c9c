"""Offline ``LLM(runner="pooling").embed()`` on the default model, against transformers' hidden states."""
from __future__ import annotations

import pytest
from hf_oracle import cosine, hf_embedding, hf_model_and_tokenizer

from pagellm import LLM, EmbeddingRequestOutput, PoolingParams, SamplingParams

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is Paris, and the capital of Italy is Rome.",
    "Continuous batching re-forms the batch every step under a token budget.",
    "hello",
    "A paged KV cache keeps keys and values in fixed-size blocks with per-request block tables.",
]
ENGINE = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes="24MiB", max_num_batched_tokens=16)
# The default path (int8 activations against the GGUF's blocks) against transformers in float32:
# the lowest cosine measured over PROMPTS was 0.99939 (LAST), 0.99967 (MEAN), 0.99982 (CLS).
# A run of special tokens ([1..7]) fares far worse under LAST (0.60): int8 activations there are not a
# faithful embedder, and no bound is claimed for such input.
INT8_COSINE = 0.999


@pytest.fixture(scope="module")
def tokenizer():
    return hf_model_and_tokenizer()[1]


@pytest.mark.parametrize("pooling_type", ["MEAN", "CLS", "LAST"])
def test_chunked_batches_match_transformers(pooling_type, tokenizer):
    # A 16-token budget: every prompt but "hello" is prefilled in chunks, beside others' chunks.
    llm = LLM(runner="pooling", pooler_config={"pooling_type": pooling_type}, **ENGINE)
    outs = llm.embed(PROMPTS * 2, use_tqdm=False)
    assert all(isinstance(o, EmbeddingRequestOutput) and o.finished for o in outs)
    for i, out in enumerate(outs):
        ids = tokenizer.encode(PROMPTS[i % len(PROMPTS)])
        assert out.prompt_token_ids == ids
        assert len(out.outputs.embedding) == out.outputs.hidden_size == 576
        assert cosine(out.outputs.embedding, hf_embedding(ids, pooling_type)) >= 0.9999, (pooling_type, i)
    llm.shutdown()


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_the_default_int8_path_stays_close_to_transformers(pooling_type, tokenizer):
    llm = LLM(runner="pooling", pooler_config={"pooling_type": pooling_type}, **{**ENGINE, "dtype": "auto"})
    for out in llm.embed(PROMPTS, use_tqdm=False):
        assert cosine(out.outputs.embedding, hf_embedding(out.prompt_token_ids, pooling_type)) >= INT8_COSINE
    llm.shutdown()


def test_pooling_params_prefix_cache_and_wrong_calls(tokenizer):
    llm = LLM(task="embed", **ENGINE)  # older vLLM's name: LAST pooling, normalized, prefix caching on
    assert llm.llm_engine.config.enable_prefix_caching
    ids = tokenizer.encode(PROMPTS[3])
    first = llm.embed({"prompt_token_ids": ids}, use_tqdm=False)[0]
    cached = llm.embed([PROMPTS[3]], use_tqdm=False)[0]  # its full blocks now come from the cache
    assert cached.num_cached_tokens > 0
    assert cosine(first.outputs.embedding, cached.outputs.embedding) >= 0.99999
    short, raw = llm.embed(
        [PROMPTS[0], PROMPTS[0]], [PoolingParams(dimensions=32), PoolingParams(normalize=False)], use_tqdm=False
    )
    p0 = tokenizer.encode(PROMPTS[0])
    assert len(short.outputs.embedding) == 32
    assert cosine(short.outputs.embedding, hf_embedding(p0, "LAST", dimensions=32)) >= 0.9999
    ref = hf_embedding(p0, "LAST", normalize=False)
    assert max(abs(a - b) for a, b in zip(raw.outputs.embedding, ref.tolist())) < 1e-3 * float(ref.abs().max())
    with pytest.raises(ValueError, match="does not generate"):
        llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed(["hi"], PoolingParams(dimensions=577), use_tqdm=False)
    with pytest.raises(ValueError, match="context length"):
        llm.embed({"prompt_token_ids": [1] * 257}, use_tqdm=False)
    assert len(llm.embed({"prompt_token_ids": [1] * 256}, use_tqdm=False)[0].outputs.embedding) == 576
    llm.shutdown()


def test_embed_on_a_generate_engine_is_refused():
    llm = LLM(**ENGINE)
    with pytest.raises(ValueError, match="does not support embeddings"):
        llm.embed(["hi"], use_tqdm=False)
    assert llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    llm.shutdown()
