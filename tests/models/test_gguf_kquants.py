"""The default model re-quantized as llama-quantize's Q4_K_M / Q5_K_M / Q6_K recipes (gguf_requant.py):
the file's types, the exact path against transformers' GGUF load, and the int8 path by vLLM's rule.

A few prompts and 24 tokens each, to keep each recipe near a quarter of a minute: the 14 prompts of
tests/engine/test_llm_vs_hf.py cover the engine's configurations, this file the block types.
"""
from __future__ import annotations

import time
from collections import Counter

import hf_oracle
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf_requant import RECIPES, requantize_default_model
from hf_oracle import check_close, hf_gguf_model, hf_greedy

from pagellm import LLM, SamplingParams
from pagellm.layers.linear_method import GGUFInt8Method, SegmentedMethod
from pagellm.models.gguf_loader import GGUFFile, iter_dequantized_gguf_weights
from pagellm.models.loader import default_model_path, eos_token_ids, load_hf_config
from pagellm.tokenizer import apply_chat_template, load_tokenizer

pytestmark = pytest.mark.slow

MAX_TOKENS = 24
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5)
# Four of test_llm_vs_hf.py's prompts: English, Chinese, code, and a chat.
TEXT_PROMPTS = [
    "The capital of France is",
    "请用中文介绍一下长城。",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]
CHAT = [{"role": "user", "content": "What is 2 + 2?"}]

# What gguf_requant writes for SmolLM2-135M (30 layers, hidden 576, intermediate 1536): 576-wide
# rows take the legacy fallback, so only ffn_down (1536 wide) is in K-quant blocks; attn_v and
# ffn_down get Q6_K in the 14 use_more_bits layers; the tied embedding is the output (Q6_K -> Q8_0).
MORE_BITS_LAYERS = [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
EXPECTED_TYPES = {
    "Q4_K_M": {T.F32: 61, T.Q5_0: 5 * 30 + 16, T.Q8_0: 14 + 1, T.Q4_K: 16, T.Q6_K: 14},
    "Q5_K_M": {T.F32: 61, T.Q5_1: 5 * 30 + 16, T.Q8_0: 14 + 1, T.Q5_K: 16, T.Q6_K: 14},
    "Q6_K": {T.F32: 61, T.Q8_0: 6 * 30 + 1, T.Q6_K: 30},
}


@pytest.fixture(scope="session")
def requantized(tmp_path_factory):
    """recipe -> (path, {tensor: type}); each file written once per session, on first use."""
    directory = tmp_path_factory.mktemp("requantized")
    files: dict[str, tuple[str, dict[str, T]]] = {}

    def get(recipe: str) -> tuple[str, dict[str, T]]:
        if recipe not in files:
            path = str(directory / f"SmolLM2-135M-Instruct.{recipe}.gguf")
            start = time.perf_counter()
            types = requantize_default_model(path, recipe)
            print(f"{recipe}: written in {time.perf_counter() - start:.1f}s")
            files[recipe] = (path, types)
        return files[recipe]

    return get


@pytest.fixture(scope="module")
def prompts() -> list[dict]:
    ours = load_tokenizer(default_model_path())
    items = [{"prompt_token_ids": ours.encode(p)} for p in TEXT_PROMPTS]
    return items + [{"prompt_token_ids": apply_chat_template(ours, CHAT)}]


@pytest.fixture(scope="module", params=list(RECIPES))
def case(request, requantized, prompts):
    """One recipe's file, transformers' model on it, and its greedy references; one at a time."""
    recipe = request.param
    path, types = requantized(recipe)
    model = hf_gguf_model(path)
    eos = eos_token_ids(path, load_hf_config(path))
    # hf_oracle's greedy loop, on this file's model instead of the default one. One thread: decode
    # steps this small gain nothing from more, and lose several times over on a busy 2-core box.
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(hf_oracle, "hf_model_and_tokenizer", lambda: (model, None))
            references = [hf_greedy(p["prompt_token_ids"], MAX_TOKENS, eos) for p in prompts]
    finally:
        torch.set_num_threads(threads)
    yield recipe, path, types, model, references


def test_file_has_the_recipes_types(case, prompts) -> None:
    recipe, path, types, _, _ = case
    stored = GGUFFile(path)
    source = GGUFFile(default_model_path())
    assert {name: info.ggml_type for name, info in stored.tensors.items()} == types
    assert Counter(types.values()) == EXPECTED_TYPES[recipe]
    assert {n: i.shape for n, i in stored.tensors.items()} == {n: i.shape for n, i in source.tensors.items()}
    assert all(types[n] == T.F32 for n, i in source.tensors.items() if len(i.shape) == 1)
    for layer in range(30):
        more = layer in MORE_BITS_LAYERS or recipe == "Q6_K"
        assert types[f"blk.{layer}.ffn_down.weight"] == (T.Q6_K if more else RECIPES[recipe][0])
        assert types[f"blk.{layer}.attn_v.weight"] == (T.Q8_0 if more else types[f"blk.{layer}.attn_q.weight"])
    assert types["token_embd.weight"] == T.Q8_0
    # Metadata copied: the same config, tokenizer and chat template; the recipe's file type.
    skip = {"general.file_type"}
    assert {k: v for k, v in stored.metadata.items() if k not in skip} == {k: v for k, v in source.metadata.items() if k not in skip}
    assert stored.array_lengths == source.array_lengths
    assert stored.metadata["general.file_type"] == int(RECIPES[recipe][1])
    assert load_tokenizer(path).encode(TEXT_PROMPTS[1]) == prompts[1]["prompt_token_ids"]


def test_float32_path_equals_transformers(case, prompts) -> None:
    recipe, path, _, model, references = case
    theirs = model.state_dict()
    ours = dict(iter_dequantized_gguf_weights(path, load_hf_config(path)))
    assert set(ours) == {k for k in theirs if k != "lm_head.weight"}
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    llm = LLM(model=path, dtype="float32")
    assert llm.llm_engine.resolved.precision.linear.exact
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outputs, references)):
        assert out.outputs[0].token_ids == ref.token_ids, f"{recipe}/{i}"
    assert llm.get_tokenizer().decode(outputs[0].outputs[0].token_ids).strip()


def test_int8_path_meets_vllms_rule(case, prompts) -> None:
    recipe, path, types, _, references = case
    llm = LLM(model=path)
    model = llm.llm_engine.core.runner.model
    kernel_types = set()
    for _, layer in model.linear_layers():
        method = layer.method
        parts = method.parts if isinstance(method, SegmentedMethod) else [method]
        if all(isinstance(p, GGUFInt8Method) for p in parts):
            kernel_types |= {p.ggml_type for p in parts}
    precision = llm.llm_engine.resolved.precision.linear
    if precision.kind == "int8":  # where the CPU has int8 dot products: every block type on the kernel
        assert kernel_types == set(types.values()) - {T.F32}
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    num_identical = sum(check_close(o, ref, f"{recipe}/{i}") for i, (o, ref) in enumerate(zip(outputs, references)))
    print(f"{recipe} ({precision.describe()}): {num_identical}/{len(prompts)} identical")
