"""Tensor parallelism on a tiny random Llama (``tiny_model`` in conftest.py) with every awkward split: 3 KV heads over 2 ranks,
an odd intermediate size, a vocabulary that pads the last rank's rows, and biases on q/k/v, o
and the MLP (row-parallel biases must be added once). Small enough to run in seconds."""
from __future__ import annotations

from pagellm import LLM, SamplingParams
from pagellm.models.loader import default_model_path


def _run(model: str, **kwargs):
    llm = LLM(model=model, tokenizer=default_model_path(), num_kv_blocks=64, max_num_seqs=4, max_model_len=128, **kwargs)
    try:
        prompts = [{"prompt_token_ids": [5 + 7 * i + j for j in range(3 + 9 * i)]} for i in range(4)]
        params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, prompt_logprobs=2, ignore_eos=True)
        return llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()


def test_tiny_tp2_matches_tp1(tiny_model):
    ref = _run(tiny_model)
    tp2 = _run(tiny_model, tensor_parallel_size=2)
    for r, t in zip(ref, tp2):
        assert t.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(r.outputs[0].logprobs, t.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[k].logprob - b[k].logprob) < 1e-3 for k in a)
        for a, b in zip(r.prompt_logprobs[1:], t.prompt_logprobs[1:]):
            assert all(abs(a[k].logprob - b[k].logprob) < 1e-3 for k in a.keys() & b.keys())


def test_tiny_tp2_eight_bit_kv_matches_tp1(tiny_model):
    # An int8 row's scale is per token and kv head, and fp8 under unit scales is per element, so each
    # rank stores its heads' bytes exactly as one rank would: the outputs agree as closely as in float32.
    for kv_cache_dtype in ("int8", "fp8"):
        ref = _run(tiny_model, kv_cache_dtype=kv_cache_dtype)
        tp2 = _run(tiny_model, tensor_parallel_size=2, kv_cache_dtype=kv_cache_dtype)
        for r, t in zip(ref, tp2):
            assert t.outputs[0].token_ids == r.outputs[0].token_ids, kv_cache_dtype
            for a, b in zip(r.outputs[0].logprobs, t.outputs[0].logprobs):
                assert all(abs(a[k].logprob - b[k].logprob) < 1e-3 for k in a.keys() & b.keys())


_UNGUARDED_SCRIPT = """
import sys
from pagellm import LLM, SamplingParams
from pagellm.models.loader import default_model_path

llm = LLM(model=sys.argv[1], tokenizer=default_model_path(), tensor_parallel_size=2, num_kv_blocks=64, max_model_len=128)
params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
print("TOKENS", list(llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)[0].outputs[0].token_ids))
llm.shutdown()
"""


def test_tp_from_a_script_without_a_main_guard(tiny_model, tmp_path):
    # Spawned ranks must not re-run the user's script (which would build an engine in each rank).
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(_UNGUARDED_SCRIPT)
    done = subprocess.run([sys.executable, str(script), tiny_model], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    tokens = [line for line in done.stdout.splitlines() if line.startswith("TOKENS")]
    llm = LLM(model=tiny_model, tokenizer=default_model_path(), num_kv_blocks=64, max_model_len=128)
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        expected = list(llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)[0].outputs[0].token_ids)
    finally:
        llm.shutdown()
    assert tokens == [f"TOKENS {expected}"]


def _greedy(llm: LLM, prompts: list[dict], max_tokens: int, lora_request=None) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_tiny_tp2_with_a_lora_adapter_matches_tp1(tiny_model, tmp_path):
    # Every adapted layer kind: q/k/v and gate/up are column-parallel (each rank's rows of B), o and
    # down row-parallel (each rank's columns of A, its partial delta summed by the all-reduce).
    from pagellm.bench.lora_adapters import write_random_adapter
    from pagellm.lora.request import LoRARequest
    from pagellm.models.loader import load_hf_config

    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    path = write_random_adapter(tmp_path / "adapter", load_hf_config(tiny_model), 8, targets, seed=3, std=0.3)
    lora = LoRARequest("tiny", 1, path)
    prompts = [{"prompt_token_ids": [5 + 7 * i + j for j in range(3 + 9 * i)]} for i in range(4)]
    results = {}
    for tp in (1, 2):
        llm = LLM(model=tiny_model, tokenizer=default_model_path(), num_kv_blocks=64, max_num_seqs=4, max_model_len=128,
                  dtype="float32", enable_lora=True, max_lora_rank=8, tensor_parallel_size=tp)
        try:
            results[tp] = (_greedy(llm, prompts, 8), _greedy(llm, prompts, 8, lora_request=lora))
        finally:
            llm.shutdown()
    base, adapted = results[1]
    assert adapted != base  # the adapter changes the tokens, so equality below says it was applied
    assert results[2] == results[1]


def test_tp_refuses_a_draft_model_at_start_up(tiny_model):
    import pytest

    with pytest.raises(ValueError, match="tensor_parallel_size 1"):
        LLM(model=tiny_model, tokenizer=default_model_path(), tensor_parallel_size=2,
            speculative_config={"model": tiny_model, "num_speculative_tokens": 2})
