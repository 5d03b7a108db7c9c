"""KV cache and recurrent state one request holds, decoding at 4,096 and 32,768 tokens: hybrid and
sliding-window shapes against a full-attention model of about the same size. What a request holds
depends only on the layers, heads and states, so every checkpoint is its shape with a narrow hidden
size and a short MLP (random weights; a Mamba layer's width kept through its expand factor). The
request is decoding: its prompt went in 1,024-token chunks and one token has been decoded since, so a
sliding group holds only its window. At 4,096 tokens the engine runs the request for real; at both
lengths (32,768 is a prefill too long for two cores to be worth it) its KV cache manager allocates the
request's blocks and slot chunk by chunk without running the model. Both are the engine's own account
of what the request holds; at 4,096 the two agree (``allocated_bytes``).

Pairs (model, full-attention model of its size): Qwen3.5-2B (18 Gated DeltaNet + 6 gated-attention
layers) against Qwen3-1.7B's attention; Granite-4.0-H-Micro (36 Mamba-2 + 4 attention layers) and
Gemma 4-E4B (five sliding W=512 to one full, 512-wide full heads, the last 18 layers reading earlier
layers' KV) against Llama-3.2-3B's attention (28 layers, 8 KV heads of 128).

``--mamba-ssm-cache-dtype bfloat16`` holds the hybrids' recurrent matrices in bfloat16 (the engine's flag).

usage: python -m pagellm.bench.kv_held_by_hybrid [--models qwen3.5-2b,granite-4.0-h-micro,gemma4-e4b]
       [--mamba-ssm-cache-dtype auto|float32|bfloat16] [OUT.json]
"""
from __future__ import annotations

import argparse
import json
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
CHUNK = 1024  # prefill chunk (max_num_batched_tokens)
NARROW = dict(vocab_size=49152, hidden_size=128, intermediate_size=128, max_position_embeddings=40000)
# (model_type, shape) of each model, and the full-attention model each is held against.
SHAPES: dict[str, tuple[str, dict]] = {
    "qwen3.5-2b": ("qwen3_5_text", dict(
        num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
    )),
    # Granite's head size is hidden / heads: 4 query heads over a 512 hidden keep its KV, 4 heads of 128.
    "granite-4.0-h-micro": ("granitemoehybrid", dict(
        hidden_size=512, num_hidden_layers=40, num_attention_heads=4, num_key_value_heads=4, num_local_experts=0,
        num_experts_per_tok=0, shared_intermediate_size=128, mamba_n_heads=64, mamba_n_groups=1, mamba_d_state=128,
        mamba_d_head=64, mamba_d_conv=4, mamba_expand=8, layer_types=(["mamba"] * 9 + ["attention"]) * 4,
        position_embedding_type="nope",
    )),
    "gemma4-e4b": ("gemma4_text", dict(
        num_hidden_layers=42, num_attention_heads=8, num_key_value_heads=2, head_dim=256, global_head_dim=512, sliding_window=512,
        num_kv_shared_layers=18, hidden_size_per_layer_input=8, vocab_size_per_layer_input=49152,
        layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 7,
    )),
    "qwen3-1.7b": ("qwen3", dict(num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128)),
    "llama-3.2-3b": ("llama", dict(hidden_size=384, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128)),
}
FULL_ATTENTION_OF = {"qwen3.5-2b": "qwen3-1.7b", "granite-4.0-h-micro": "llama-3.2-3b", "gemma4-e4b": "llama-3.2-3b"}


def held(model_type: str, shape: dict, num_tokens: int, mamba_ssm_cache_dtype: str = "auto") -> dict:
    config = AutoConfig.for_model(model_type, **{**NARROW, **shape})
    with tempfile.TemporaryDirectory() as path:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        engine = LLMEngine(EngineConfig(
            model=path, tokenizer=default_model_path(), dtype="bfloat16", max_model_len=max(CONTEXTS) + 64,
            max_num_batched_tokens=CHUNK, kv_cache_memory_bytes=8 << 30, max_num_seqs=4, enable_prefix_caching=False,
            mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
        ))
        core = engine.core
        prompt = [(7 * i) % 49000 + 10 for i in range(num_tokens)]
        # What the manager hands a request of this length (no model run): its prompt in chunks of
        # CHUNK, then one decode step, so sliding groups hold only their window; then it is forgotten.
        request = Request("sized", prompt, SamplingParams(max_tokens=1), 1)
        for start in range(0, num_tokens, CHUNK):
            core.kv_cache_manager.allocate_slots(request, min(CHUNK, num_tokens - start))
            request.num_computed_tokens = min(start + CHUNK, num_tokens)
        core.kv_cache_manager.allocate_slots(request, 1)
        allocated = core.request_kv_usage("sized").num_bytes
        core.kv_cache_manager.free(request)
        result = {"layout": engine.memory_plan.kv_cache_layout or "one full-attention group", "allocated_bytes": allocated}
        if num_tokens <= 4096:
            engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=4, ignore_eos=True), RequestOutputKind.DELTA)
            while True:  # until the prompt is in and the first token sampled
                outputs = engine.step()
                if outputs and outputs[0].outputs[0].token_ids:
                    break
            engine.step()  # one decode step: a sliding group has let go of the last chunk's blocks out of its window
            usage = core.request_kv_usage("r")
            result.update(kv_bytes=usage.num_bytes - usage.num_state_bytes, state_bytes=usage.num_state_bytes, bytes_held=usage.num_bytes)
        engine.shutdown()
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(FULL_ATTENTION_OF), help="comma-separated, of " + ", ".join(FULL_ATTENTION_OF))
    parser.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="the hybrids' recurrent matrices' type (auto: float32)")
    parser.add_argument("out", nargs="?", help="write the report here as JSON")
    args = parser.parse_args()
    report: dict[str, dict] = {}
    full_held: dict[tuple[str, int], dict] = {}
    for name in args.models.split(","):
        if name not in FULL_ATTENTION_OF:
            parser.error(f"unknown model {name!r}; known: {', '.join(FULL_ATTENTION_OF)}")
        full_name = FULL_ATTENTION_OF[name]
        for n in CONTEXTS:
            model = held(*SHAPES[name], n, args.mamba_ssm_cache_dtype)
            if (full_name, n) not in full_held:
                full_held[full_name, n] = held(*SHAPES[full_name], n)
            full = full_held[full_name, n]
            entry = {name: model, full_name: full, "bytes_ratio": round(model["allocated_bytes"] / full["allocated_bytes"], 3)}
            report[f"{name}@{n}"] = entry
            print(name, n, json.dumps(entry), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
