"""KV cache one request holds at 4,096 tokens, decoding: a Gemma 3-1B-shape model (26 layers, one KV head of
256, five sliding layers of 512 tokens to one global) against the same model with every layer
full attention. The KV held depends only on the layers, KV heads and windows, so the checkpoint is
Gemma 3-1B's attention with a narrow hidden size (random weights) and runs in seconds.

usage: python -m pagellm.bench.kv_held_by_window [OUT.json]
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

PROMPT_TOKENS = 4096
GEMMA3_1B = dict(
    num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512, sliding_window_pattern=6
)


def held(sliding: bool) -> dict:
    narrow = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, query_pre_attn_scalar=256)
    config = AutoConfig.for_model("gemma3_text", **narrow, **GEMMA3_1B)
    if not sliding:
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        engine = LLMEngine(
            EngineConfig(model=path, tokenizer=default_model_path(), dtype="bfloat16", max_model_len=8192, max_num_batched_tokens=1024)
        )
        prompt = {"prompt_token_ids": [(7 * i) % 49000 + 10 for i in range(PROMPT_TOKENS)]}
        engine.add_request("r", prompt, SamplingParams(max_tokens=4, ignore_eos=True), RequestOutputKind.DELTA)
        while True:  # until the prompt is in and the first token sampled
            outputs = engine.step()
            if outputs and outputs[0].outputs[0].token_ids:
                break
        # Right after the last prefill chunk a sliding group still holds that chunk (it was all
        # written this step); one decode step later only the window is left.
        after_prefill = engine.core.request_kv_usage("r")
        engine.step()
        decoding = engine.core.request_kv_usage("r")
        result = {
            "layout": engine.memory_plan.kv_cache_layout or "one full-attention group",
            "block_bytes": engine.core.kv_block_bytes,
            "blocks_after_prefill": after_prefill.num_blocks,
            "blocks_held": decoding.num_blocks,
            "bytes_held": decoding.num_bytes,
            "kv_cache_usage": round(engine.core.stats().scheduler.kv_cache_usage, 4),
        }
        engine.shutdown()
        return result


if __name__ == "__main__":
    full, hybrid = held(sliding=False), held(sliding=True)
    ratio = round(hybrid["bytes_held"] / full["bytes_held"], 3)
    report = {"prompt_tokens": PROMPT_TOKENS, "all_full": full, "gemma3": hybrid, "bytes_ratio": ratio}
    print(json.dumps(report, indent=1))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(report, f, indent=1)
