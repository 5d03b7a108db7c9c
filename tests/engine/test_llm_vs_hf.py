"""Greedy output of the default model equals Hugging Face transformers' on the same GGUF weights.

One batch of varied prompts (English, Chinese, emoji, code, a prompt over 1,500 tokens, token-id
prompts around block boundaries, chat conversations), under several engine configurations:
block sizes 8/16/32, a KV budget so small that requests get preempted, and chunked prefill at a
tiny token budget, a float16 or bfloat16 KV cache, all on the exact float32 path. Each must match
transformers by vLLM's rule. Then each low-precision path of the linear layers (the default: int8
dot products on the GGUF blocks, and bfloat16), which must meet vLLM's rule on every prompt;
how many stay identical is printed (``pytest -s -k low_precision``).
"""
from __future__ import annotations

import random

import pytest
import torch
from hf_oracle import check_close, hf_greedy, hf_model_and_tokenizer

from pagellm import LLM, SamplingParams

pytestmark = pytest.mark.slow

MAX_TOKENS = 24

TEXT_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "请用中文介绍一下长城。",
    "Translate to emoji: happy birthday party 🎉🎂",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]
CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ],
]
TOKEN_PROMPT_LENGTHS = [1, 15, 16, 17, 32, 33]


def _long_prompt() -> str:
    sentences = [
        "The history of computing is a story of layers, each built on the last.",
        "Engineers traded memory for speed and speed for memory, again and again.",
        "Caches appeared wherever a slow thing fed a fast one.",
    ]
    return " ".join(sentences[i % 3] + f" Note {i}." for i in range(110))


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    _, tokenizer = hf_model_and_tokenizer()
    from pagellm.models.loader import default_model_path
    from pagellm.tokenizer import apply_chat_template, load_tokenizer

    ours = load_tokenizer(default_model_path())
    rng = random.Random(0)
    special = set(tokenizer.all_special_ids)
    items = [{"prompt_token_ids": ours.encode(p)} for p in TEXT_PROMPTS + [_long_prompt()]]
    for n in TOKEN_PROMPT_LENGTHS:
        ids = []
        while len(ids) < n:
            t = rng.randrange(100, tokenizer.vocab_size)
            if t not in special:
                ids.append(t)
        items.append({"prompt_token_ids": ids})
    for chat in CHATS:
        items.append({"prompt_token_ids": apply_chat_template(ours, chat)})
    # Our tokenizer must agree with transformers' on the text prompts.
    for p, item in zip(TEXT_PROMPTS, items):
        assert item["prompt_token_ids"] == tokenizer.encode(p), p
    assert len(items[len(TEXT_PROMPTS)]["prompt_token_ids"]) > 1500
    return items


@pytest.fixture(scope="module")
def references(prompts):
    from pagellm.models.loader import default_model_path, eos_token_ids, load_hf_config

    path = default_model_path()
    eos = eos_token_ids(path, load_hf_config(path))
    return [hf_greedy(p["prompt_token_ids"], MAX_TOKENS, eos) for p in prompts]


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5)

EXACT = dict(dtype="float32")
CONFIGS = {
    "float32": EXACT,
    "block8": dict(EXACT, block_size=8),
    "block32": dict(EXACT, block_size=32),
    # Too small for everything at once: the long prompt alone needs ~133 of the 140 blocks.
    "preemption": dict(EXACT, num_kv_blocks=140, max_num_batched_tokens=2048),
    "chunked": dict(EXACT, max_num_batched_tokens=64, max_num_seqs=4),
    # Keys and values rounded to 16 bits in the cache, everything else float32.
    "kv_float16": dict(EXACT, kv_cache_dtype="float16"),
    "kv_bfloat16": dict(EXACT, kv_cache_dtype="bfloat16"),
}
# Keys and values in 8 bits (pagellm.attention.kv_quant), everything else float32, with the number
# of the 14 prompts that must meet vLLM's rule: all, except fp8_e5m2, whose 2 mantissa bits move
# two prompts' tokens out of transformers' top-5 at their first difference (docs/kv_cache.md);
# identical tokens are only counted.
EIGHT_BIT_KV = {
    "kv_fp8_e4m3": (dict(EXACT, kv_cache_dtype="fp8_e4m3"), 14),
    "kv_fp8_e4m3_calculated_scales": (dict(EXACT, kv_cache_dtype="fp8", calculate_kv_scales=True), 14),
    "kv_fp8_e5m2": (dict(EXACT, kv_cache_dtype="fp8_e5m2"), 12),
    "kv_int8": (dict(EXACT, kv_cache_dtype="int8"), 14),
    # Preempted and recomputed requests rewrite their blocks; prefix-cached blocks are read back.
    "kv_int8_preemption": (dict(EXACT, kv_cache_dtype="int8", num_kv_blocks=140, max_num_batched_tokens=2048), 14),
}
# The linear layers in low precision (where this CPU has the instructions; float32 elsewhere):
# vLLM's rule on every prompt is the bar, identical tokens are only counted.
LOW_PRECISION = {
    "default": dict(),  # int8 on the GGUF blocks, a bfloat16 KV cache
    "int8_float32_kv": dict(quantization="gguf", dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
}


def run_and_check(llm: LLM, name: str, prompts, references) -> int:
    """Generates, checks every output by vLLM's rule, and returns how many are identical."""
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert [o.request_id for o in outputs] == sorted((o.request_id for o in outputs), key=int)
    return sum(check_close(o, ref, f"{name}/{i}") for i, (o, ref) in enumerate(zip(outputs, references)))


@pytest.mark.parametrize("name", list(LOW_PRECISION))
def test_low_precision_paths_meet_vllms_rule(name, prompts, references):
    llm = LLM(**LOW_PRECISION[name])
    num_identical = run_and_check(llm, name, prompts, references)
    print(f"{name} ({llm.llm_engine.resolved.precision.linear.describe()}): {num_identical}/{len(prompts)} identical")


@pytest.mark.parametrize("name", list(EIGHT_BIT_KV))
def test_eight_bit_kv_caches_meet_vllms_rule(name, prompts, references):
    config, num_required = EIGHT_BIT_KV[name]
    llm = LLM(**config)
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    verdicts = []
    for i, (output, ref) in enumerate(zip(outputs, references)):
        try:
            verdicts.append("identical" if check_close(output, ref, f"{name}/{i}") else "close")
        except AssertionError as e:
            verdicts.append(f"fails: {e}")
    num_meeting = sum(not v.startswith("fails") for v in verdicts)
    failures = [f"prompt {i}: {v}" for i, v in enumerate(verdicts) if v.startswith("fails")]
    print(f"{name}: {verdicts.count('identical')}/{len(prompts)} identical, {num_meeting} meet vLLM's rule {failures}")
    assert num_meeting >= num_required, failures
    core = llm.llm_engine.core
    expected = {"fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}.get(config["kv_cache_dtype"], torch.float8_e4m3fn)
    assert {cache.dtype for cache in core.runner.kv_caches} == {expected}
    scales = core.runner.model.kv_scales()
    if config.get("calculate_kv_scales"):  # measured from the first step: no longer 1.0, and fixed
        assert all(not s.calculate and s.k_scale != 1.0 and s.v_scale != 1.0 for s in scales)
    else:
        assert all(s.k_scale == 1.0 and s.v_scale == 1.0 for s in scales)
    if name.endswith("preemption"):
        assert core.stats().scheduler.num_preemptions > 0
    core.kv_cache_manager.check_integrity()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_transformers(name, prompts, references):
    llm = LLM(**CONFIGS[name])
    num_identical = run_and_check(llm, name, prompts, references)
    print(f"{name}: {num_identical}/{len(prompts)} identical")
    # Near-ties may flip under a different batch shape, but almost everything must be identical.
    assert num_identical >= len(prompts) - 2, f"only {num_identical} of {len(prompts)} identical"
    assert llm.llm_engine.resolved.precision.linear.exact
    core = llm.llm_engine.core
    if name == "preemption":
        assert core.stats().scheduler.num_preemptions > 0
    if name.startswith("kv_"):
        assert {cache.dtype for cache in core.runner.kv_caches} == {getattr(torch, CONFIGS[name]["kv_cache_dtype"])}
    core.kv_cache_manager.check_integrity()
    assert core.kv_cache_manager.block_pool.num_used_blocks == 0


def test_chat_api_equals_templated_prompt(prompts):
    llm = LLM(**EXACT)
    chat_out = llm.chat(CHATS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    gen_out = llm.generate(prompts[-2:], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in chat_out] == [o.outputs[0].token_ids for o in gen_out]
    assert chat_out[0].outputs[0].text.strip()
