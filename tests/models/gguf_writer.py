"""A Hugging Face checkpoint written as a GGUF file the way llama.cpp's converter writes it, for
the architectures the test suite builds tiny checkpoints of (the converter itself is not on the
CI machine). Names come from gguf-py's ``TensorNameMap`` (the converter's own table), and the
converter's conventions are applied: llama's Q/K row permutation, Gemma's norms stored as
``1 + w``, experts stacked into one ``[experts, rows, cols]`` tensor per projection, and the
linear-attention layers of Qwen3-Next / Qwen3.5 as conversion/qwen.py writes them (``_linear_attention``)."""
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
    "qwen3_next": MODEL_ARCH.QWEN3NEXT,
    "qwen3_5_text": MODEL_ARCH.QWEN35,
    "qwen3_5_moe_text": MODEL_ARCH.QWEN35MOE,
}
HYBRID = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# What the converter writes for Qwen3.5 when a checkpoint's rope parameters have no mrope_section.
_QWEN35_DEFAULT_MROPE_SECTION = [11, 11, 10, 0]
_EXPERT = re.compile(r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight$")


def _permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: each head's rotary halves interleaved."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tiled(t: torch.Tensor, dim: int, config: PretrainedConfig, width: int) -> torch.Tensor:
    """The converter's _reorder_v_heads: value heads from grouped by key head to tiled."""
    num_k, per_k = config.linear_num_key_heads, config.linear_num_value_heads // config.linear_num_key_heads
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], num_k, per_k, width, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)


def _linear_attention(name: str, t: torch.Tensor, config: PretrainedConfig) -> list[tuple[str, torch.Tensor]]:
    """A Qwen3-Next / Qwen3.5 tensor as conversion/qwen.py's Qwen3NextModel (and, for Qwen3.5,
    _LinearAttentionVReorderBase before it) turns it: (HF-style name for TensorNameMap, tensor)."""
    num_k, num_v = config.linear_num_key_heads, config.linear_num_value_heads
    k_dim, v_dim = config.linear_key_head_dim, config.linear_value_head_dim
    key_rows = 2 * num_k * k_dim
    if config.model_type != "qwen3_next" and num_k != num_v and "linear_attn." in name:
        if ".in_proj_qkv." in name:
            t = torch.cat([t[:key_rows], _tiled(t[key_rows:], 0, config, v_dim)])
        elif ".in_proj_z." in name:
            t = _tiled(t, 0, config, v_dim)
        elif ".in_proj_b." in name or ".in_proj_a." in name or name.endswith((".A_log", ".dt_bias")):
            t = _tiled(t, 0, config, 1)
        elif ".conv1d" in name:
            t = torch.cat([t[:key_rows], _tiled(t[key_rows:], 0, config, v_dim)])
        elif ".out_proj." in name:
            t = _tiled(t, 1, config, v_dim)
    if name.endswith(".A_log"):
        t = -torch.exp(t)
    elif name.endswith(".dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif "conv1d" in name:
        t = t.squeeze()
    elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        t = t + 1
    if "in_proj_qkvz.weight" in name:  # per key head [q, k, v, z] -> attn_qkv [all q, all k, all v] and attn_gate [z]
        per_head = t.reshape(num_k, -1, t.shape[-1])
        v_rows = num_v // num_k * v_dim
        q, k, v, z = per_head.split([k_dim, k_dim, v_rows, v_rows], dim=1)
        base = name.removesuffix(".in_proj_qkvz.weight")
        qkv = torch.cat([x.reshape(-1, t.shape[-1]) for x in (q, k, v)])
        return [(f"{base}.in_proj_qkv.weight", qkv), (f"{base}.in_proj_z.weight", z.reshape(-1, t.shape[-1]))]
    return [(name, t)]


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
        if config.model_type in HYBRID:
            out.update(_linear_attention(name, t, config))
            continue
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


def _converter_options(
    tensors: dict[str, torch.Tensor], config: PretrainedConfig, fuse_qkv: bool, fuse_gate_up_exps: bool, mtp_layers: int
) -> dict[str, torch.Tensor]:
    """The converter's --fuse-qkv (q, k, v rows stacked into attn_qkv), --fuse-gate-up-exps (each
    expert's gate rows, then its up rows, in ffn_gate_up_exps), and the MTP blocks a Qwen3-Next /
    Qwen3.5 checkpoint converts without --no-mtp (here copies of the last layer with random nextn
    tensors; names starting with blk. are GGUF names already)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        m = re.match(r"^model\.layers\.(\d+)\.(self_attn\.[qkv]_proj|mlp\.experts\.(?:gate|up)_proj)\.weight$", name)
        if m and ((fuse_qkv and "self_attn" in name) or (fuse_gate_up_exps and "experts" in name)):
            layer, proj = m.group(1), m.group(2)
            if proj in ("self_attn.q_proj", "mlp.experts.gate_proj"):  # the first part: the fused tensor goes here
                if "self_attn" in proj:
                    parts = [tensors[f"model.layers.{layer}.self_attn.{p}_proj.weight"] for p in "qkv"]
                    out[f"model.layers.{layer}.self_attn.qkv_proj.weight"] = torch.cat(parts)
                else:
                    parts = [tensors[f"model.layers.{layer}.mlp.experts.{p}_proj.weight"] for p in ("gate", "up")]
                    out[f"blk.{layer}.ffn_gate_up_exps.weight"] = torch.cat(parts, dim=1)
            continue
        out[name] = t
    last = config.num_hidden_layers - 1
    generator = torch.Generator().manual_seed(0)
    for extra in range(config.num_hidden_layers, config.num_hidden_layers + mtp_layers):
        for name in [n for n in out if n.startswith(f"model.layers.{last}.")]:
            out[name.replace(f".{last}.", f".{extra}.", 1)] = out[name].clone()
        out[f"blk.{extra}.nextn.eh_proj.weight"] = torch.randn(config.hidden_size, 2 * config.hidden_size, generator=generator)
        for norm in ("enorm", "hnorm", "shared_head_norm"):
            out[f"blk.{extra}.nextn.{norm}.weight"] = torch.randn(config.hidden_size, generator=generator)
    return out


def write_gguf(
    model_dir: Path,
    config: PretrainedConfig,
    path: Path,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    fuse_qkv: bool = False,
    fuse_gate_up_exps: bool = False,
    mtp_layers: int = 0,
) -> Path:
    arch = ARCHS[config.model_type]
    name_map = TensorNameMap(arch, config.num_hidden_layers + mtp_layers)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers + mtp_layers)
    if mtp_layers:
        writer.add_nextn_predict_layers(mtp_layers)
    if getattr(config, "intermediate_size", None):  # Qwen3.5-MoE has none
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
    if config.model_type in ("qwen3_moe", "qwen3_next", "qwen3_5_moe_text"):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if config.model_type in HYBRID:  # Qwen3NextModel.set_gguf_parameters
        if getattr(config, "shared_expert_intermediate_size", None):
            writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
        writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
        writer.add_ssm_state_size(config.linear_key_head_dim)
        writer.add_ssm_group_count(config.linear_num_key_heads)
        writer.add_ssm_time_step_rank(config.linear_num_value_heads)
        writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
        recurrent = [t == "linear_attention" for t in config.layer_types] + [False] * mtp_layers
        writer.add_array(f"{writer.arch}.attention.recurrent_layers", recurrent)  # gguf-py's Keys.Attention.RECURRENT_LAYERS
        writer.add_full_attention_interval(getattr(config, "full_attention_interval", 4))
        if config.model_type != "qwen3_next":
            writer.add_rope_dimension_sections((list(params.get("mrope_section", _QWEN35_DEFAULT_MROPE_SECTION)) + [0] * 4)[:4])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    tensors = _converter_options(_tensors(model_dir, config), config, fuse_qkv, fuse_gate_up_exps, mtp_layers)
    for name, t in tensors.items():
        gguf_name = name if name.startswith("blk.") else name_map.get_name(name, try_suffixes=(".weight", ".bias"))
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
