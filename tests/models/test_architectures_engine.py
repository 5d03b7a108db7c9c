"""Each architecture served by the engine: greedy decoding against transformers' by vLLM's rule
(equal ids, or at the first difference each side's token in the other's top-5) under chunked
prefill and preemption, with prompts longer than the sliding window; and tensor parallelism on
two ranks against one."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf_writer import write_gguf
from hf_oracle import HFGreedy, check_close, hf_greedy_uncached
from model_utils import make_random_hf_model
from test_architectures import CONFIGS, GGUF_CONFIGS

from pagellm import LLM, SamplingParams
from pagellm.models.loader import default_model_path, load_hf_config
from pagellm.models.shape import ModelShape

pytestmark = pytest.mark.slow

_PROMPT_LENS = (30, 23, 41, 12)
_MAX_TOKENS = 12


def _prompts() -> list[list[int]]:
    return [[(7 * i + 13 * j) % 120 + 3 for j in range(n)] for i, n in enumerate(_PROMPT_LENS)]


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path, list[HFGreedy]]:
    path = tmp_path_factory.mktemp(request.param)
    hf_model = make_random_hf_model(CONFIGS[request.param][0](), seed=1)
    hf_model.save_pretrained(path)
    return request.param, path, [hf_greedy_uncached(hf_model, p, _MAX_TOKENS) for p in _prompts()]


def _generate(path: Path, **kwargs):
    llm = LLM(model=str(path), tokenizer=default_model_path(), dtype="float32", max_model_len=64, **kwargs)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=_MAX_TOKENS, logprobs=5, ignore_eos=True)
        return llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    finally:
        llm.shutdown()


def test_engine_greedy_matches_transformers(checkpoint) -> None:
    name, path, reference = checkpoint
    # 96 tokens of every layer's KV (float32) cannot hold the four full-attention requests at
    # once: some are preempted and recomputed; 16 tokens a step split every prompt into chunks.
    shape = ModelShape.from_hf_config(load_hf_config(str(path)))
    token_bytes = 2 * sum(heads * dim for heads, dim in map(shape.kv_heads_of, shape.kv_layer_ids)) * 4
    outputs = _generate(path, block_size=4, kv_cache_memory_bytes=96 * token_bytes, max_num_batched_tokens=16, max_num_seqs=4)
    for i, (ours, ref) in enumerate(zip(outputs, reference)):
        check_close(ours, ref, f"{name} prompt {i}")


def test_tensor_parallel_two_ranks_match_one(checkpoint) -> None:
    name, path, _ = checkpoint
    one = _generate(path, num_kv_blocks=64)
    two = _generate(path, num_kv_blocks=64, tensor_parallel_size=2)
    for a, b in zip(one, two):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, name
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert all(abs(x[k].logprob - y[k].logprob) < 1e-3 for k in x.keys() & y.keys()), name


@pytest.mark.parametrize("name", GGUF_CONFIGS)
def test_gguf_file_served_matches_transformers_on_one_and_two_ranks(name: str, tmp_path: Path) -> None:
    hf_model = make_random_hf_model(CONFIGS[name][0](), seed=1)
    hf_model.save_pretrained(tmp_path / "hf")
    gguf_path = write_gguf(tmp_path / "hf", hf_model.config, tmp_path / "model.gguf")
    reference = [hf_greedy_uncached(hf_model, p, _MAX_TOKENS) for p in _prompts()]
    one = _generate(gguf_path, num_kv_blocks=64)
    two = _generate(gguf_path, num_kv_blocks=64, tensor_parallel_size=2)
    for i, (a, b, ref) in enumerate(zip(one, two, reference)):
        check_close(a, ref, f"{name} GGUF prompt {i}")
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, name


@pytest.mark.parametrize("source", ["safetensors", "gguf"])
@pytest.mark.parametrize("name", ["gemma4", "gemma4-moe-k-eq-v"])
def test_prefix_caching_equals_no_caching(name: str, source: str, tmp_path: Path) -> None:
    """Prompts sharing a stem cut inside a 4-token block, each sent after the one it shares with:
    hits skip the stem's full blocks (sliding windows and layers reading another's KV included)
    and change no token, from safetensors and from a GGUF file."""
    hf_model = make_random_hf_model(CONFIGS[name][0](), seed=1)
    hf_model.save_pretrained(tmp_path / "hf")
    model = tmp_path / "hf" if source == "safetensors" else write_gguf(tmp_path / "hf", hf_model.config, tmp_path / "model.gguf")
    stem = [(5 * j + 3) % 120 + 3 for j in range(45)]
    prompts = [stem + [7, 8, 9], stem[:30] + [11, 12], stem[:41] + [21, 22, 23], stem[:37] + [1]]
    reference = [hf_greedy_uncached(hf_model, p, _MAX_TOKENS) for p in prompts]

    def run(caching: bool):
        llm = LLM(model=str(model), tokenizer=default_model_path(), dtype="float32", max_model_len=96, block_size=4,
                  num_kv_blocks=128, max_num_batched_tokens=16, enable_prefix_caching=caching)
        try:
            params = SamplingParams(temperature=0.0, max_tokens=_MAX_TOKENS, logprobs=5, ignore_eos=True)
            return [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]
        finally:
            llm.shutdown()

    cached, plain = run(True), run(False)
    assert [o.num_cached_tokens for o in cached] == [0, 28, 40, 36]  # each stem's full blocks (30, 41, 37 tokens)
    for i, (a, b, ref) in enumerate(zip(cached, plain, reference)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, f"{name} prompt {i}: caching changed the output"
        check_close(a, ref, f"{name} prompt {i}")


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
@pytest.mark.parametrize("name", ["gemma4"])
def test_eight_bit_kv_cache_of_layers_of_different_shapes(name: str, kv_cache_dtype: str, tmp_path: Path) -> None:
    """Gemma 4's sliding layers keep their 8-bit rows (an int8 row's scales included) in the first
    part of its full layers' wider rows (pagellm.worker.kv_cache): greedy still matches transformers."""
    hf_model = make_random_hf_model(CONFIGS[name][0](), seed=1)
    hf_model.save_pretrained(tmp_path)
    reference = [hf_greedy_uncached(hf_model, p, _MAX_TOKENS) for p in _prompts()]
    llm = LLM(model=str(tmp_path), tokenizer=default_model_path(), dtype="float32", max_model_len=64, block_size=4, num_kv_blocks=96,
              max_num_batched_tokens=16, kv_cache_dtype=kv_cache_dtype)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=_MAX_TOKENS, logprobs=5, ignore_eos=True)
        outputs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
        caches = [c for c in llm.llm_engine.core.runner.kv_caches if c is not None]
    finally:
        llm.shutdown()
    assert {c.dtype for c in caches} == {torch.int8 if kv_cache_dtype == "int8" else torch.float8_e4m3fn}
    assert any(not c.is_contiguous() for c in caches)  # the sliding layers' views into the full layers' rows
    for i, (ours, ref) in enumerate(zip(outputs, reference)):
        check_close(ours, ref, f"{name} {kv_cache_dtype} KV cache prompt {i}")
