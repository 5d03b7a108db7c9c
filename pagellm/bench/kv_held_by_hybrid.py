"""KV cache and recurrent state one request holds, decoding at 4,096 and 32,768 tokens: a Qwen3.5-2B-
shape hybrid (18 Gated DeltaNet layers with a fixed state, 6 gated-attention layers with 2 KV heads of
256) against a full-attention model of the same size (Qwen3-1.7B's attention: 28 layers, 8 KV heads
of 128). What a request holds depends only on the layers, heads and states, so both checkpoints are
those shapes with a narrow hidden size and a short MLP (random weights). At 4,096 tokens the engine
runs the request for real; at 32,768 (a prefill too long for two cores to be worth it) its KV cache
manager allocates the request's blocks and slot without running the model. Both are the engine's
own account of what the request holds; at 4,096 the two agree (``allocated_bytes``).

usage: python -m pagellm.bench.kv_held_by_hybrid [OUT.json]
"""
from __future__ import annotations

import json
import sys
import tempfile

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pagellm import SamplingParams
from pagellm.config import EngineConfig
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.output_processor import RequestOutputKind
from pagellm.models.loader import default_model_path
from pagellm.request import Request

CONTEXTS = (4096, 32768)
NARROW = dict(vocab_size=49152, hidden_size=128, intermediate_size=128, max_position_embeddings=40000)
QWEN35_2B = dict(
    num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
    linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
)
QWEN3_17B = dict(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128)


def held(model_type: str, shape: dict, num_tokens: int) -> dict:
    config = AutoConfig.for_model(model_type, **NARROW, **shape)
    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        engine = LLMEngine(EngineConfig(
            model=path, tokenizer=default_model_path(), dtype="bfloat16", max_model_len=max(CONTEXTS) + 64,
            max_num_batched_tokens=4096, kv_cache_memory_bytes=8 << 30, max_num_seqs=4, enable_prefix_caching=False,
        ))
        core = engine.core
        prompt = [(7 * i) % 49000 + 10 for i in range(num_tokens)]
        # What the manager hands a request of this length (no model run), then forgets it.
        request = Request("sized", prompt, SamplingParams(max_tokens=1), 1)
        core.kv_cache_manager.allocate_slots(request, num_tokens)
        allocated = core.request_kv_usage("sized").num_bytes
        core.kv_cache_manager.free(request)
        result = {"layout": engine.memory_plan.kv_cache_layout or "one full-attention group", "allocated_bytes": allocated}
        if num_tokens <= 4096:
            engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, ignore_eos=True), RequestOutputKind.DELTA)
            while True:  # until the prompt is in and the first token sampled
                outputs = engine.step()
                if outputs and outputs[0].outputs[0].token_ids:
                    break
            usage = core.request_kv_usage("r")
            result.update(kv_bytes=usage.num_bytes - usage.num_state_bytes, state_bytes=usage.num_state_bytes, bytes_held=usage.num_bytes)
        engine.shutdown()
        return result


if __name__ == "__main__":
    report = {}
    for n in CONTEXTS:
        hybrid, full = held("qwen3_5_text", QWEN35_2B, n), held("qwen3", QWEN3_17B, n)
        ratio = round(hybrid["allocated_bytes"] / full["allocated_bytes"], 3)
        report[n] = {"qwen3.5-2b": hybrid, "qwen3-1.7b": full, "bytes_ratio": ratio}
        print(n, json.dumps(report[n]), flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(report, f, indent=1)
