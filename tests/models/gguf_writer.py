"""A Hugging Face checkpoint written as a GGUF file the way llama.cpp's converter writes it, for
the architectures the test suite builds tiny checkpoints of (the converter itself is not on the
CI machine). Names come from gguf-py's ``TensorNameMap`` (the converter's own table), and the
converter's conventions are applied: llama's Q/K row permutation, Gemma's norms stored as
``1 + w``, experts stacked into one ``[experts, rows, cols]`` tensor per projection."""
from __future__ import annotations

import math
import re
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import MODEL_ARCH, GGMLQuantizationType, TensorNameMap
from safetensors.torch import load_file
from transformers import PretrainedConfig

ARCHS = {
    "llama": MODEL_ARCH.LLAMA,
    "mixtral": MODEL_ARCH.LLAMA,
    "qwen3": MODEL_ARCH.QWEN3,
    "qwen3_moe": MODEL_ARCH.QWEN3MOE,
    "gemma3_text": MODEL_ARCH.GEMMA3,
    "phi3": MODEL_ARCH.PHI3,
    "gpt_oss": MODEL_ARCH.GPT_OSS,
}
_EXPERT = re.compile(r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight$")


def _permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: each head's rotary halves interleaved."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensors(model_dir: Path, config: PretrainedConfig) -> dict[str, torch.Tensor]:
    weights = load_file(str(model_dir / "model.safetensors"))
    experts: dict[str, dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        m = _EXPERT.match(name)
        if m:
            experts.setdefault(f"{m.group(1)}.{m.group(3)}.weight", {})[int(m.group(2))] = t
            continue
        if config.model_type in ("llama", "mixtral") and name.endswith("q_proj.weight"):
            t = _permute(t, config.num_attention_heads)
        elif config.model_type in ("llama", "mixtral") and name.endswith("k_proj.weight"):
            t = _permute(t, config.num_key_value_heads)
        if config.model_type == "gemma3_text" and name.endswith("norm.weight"):
            t = t + 1
        out[name] = t
    for name, parts in experts.items():
        out[name] = torch.stack([parts[e] for e in sorted(parts)])
    if config.model_type == "gpt_oss":  # stacked input-major experts, gate/up interleaved: split as llama.cpp does
        stacked = ("experts.gate_up_proj", "experts.gate_up_proj_bias", "experts.down_proj", "experts.down_proj_bias")
        for name in [n for n in out if n.endswith(stacked)]:
            t = out.pop(name)
            base = name.rsplit(".", 1)[0]
            if name.endswith("gate_up_proj"):
                t = t.transpose(-1, -2)
                out[f"{base}.gate_proj.weight"], out[f"{base}.up_proj.weight"] = t[:, ::2, :], t[:, 1::2, :]
            elif name.endswith("gate_up_proj_bias"):
                out[f"{base}.gate_proj.bias"], out[f"{base}.up_proj.bias"] = t[..., ::2], t[..., 1::2]
            elif name.endswith("down_proj"):
                out[f"{base}.down_proj.weight"] = t.transpose(-1, -2)
            else:
                out[f"{base}.down_proj.bias"] = t
        for name in [n for n in out if n.endswith("self_attn.sinks")]:
            out[name + ".weight"] = out.pop(name)
    return out


def write_gguf(model_dir: Path, config: PretrainedConfig, path: Path, qtype: GGMLQuantizationType = GGMLQuantizationType.F32) -> Path:
    arch = ARCHS[config.model_type]
    name_map = TensorNameMap(arch, config.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    params = config.rope_parameters
    if config.model_type == "gpt_oss":
        writer.add_sliding_window(config.sliding_window)
        writer.add_expert_feed_forward_length(config.intermediate_size)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(params["factor"])
        writer.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
    if config.model_type == "gemma3_text":
        params = params["full_attention"]
        writer.add_sliding_window(config.sliding_window)
        if params.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(params["factor"])
    writer.add_rope_freq_base(params["rope_theta"])
    writer.add_rope_dimension_count(int(head_dim * params.get("partial_rotary_factor", 1.0)))
    if config.model_type == "phi3":  # as llama.cpp's converter: 0 for no window, LongRoPE as tensors
        writer.add_sliding_window(config.sliding_window or 0)
        if params.get("rope_type") == "longrope":
            original = params["original_max_position_embeddings"]
            writer.add_rope_scaling_orig_ctx_len(original)
            scale = config.max_position_embeddings / original
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)
            writer.add_tensor("rope_factors_long.weight", np.array(params["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.array(params["short_factor"], dtype=np.float32))
    num_experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if config.model_type == "qwen3_moe":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    for name, t in _tensors(model_dir, config).items():
        gguf_name = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"no GGUF name for {name}")
        data = t.float().numpy()
        # llama-quantize leaves norms, biases and the MoE router in float.
        quantize = data.ndim >= 2 and data.shape[-1] % 32 == 0 and name.endswith(".weight") and "norm" not in name
        quantize = quantize and "gate_inp" not in gguf_name
        kind = qtype if quantize else GGMLQuantizationType.F32
        if kind == GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, np.ascontiguousarray(data))
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
