"""A Hugging Face checkpoint written as a GGUF file the way llama.cpp's converter writes it, for
the architectures the test suite builds tiny checkpoints of (the converter itself is not on the
CI machine). Names come from gguf-py's ``TensorNameMap`` (the converter's own table), and the
converter's conventions are applied: llama's Q/K row permutation, Gemma's norms stored as
``1 + w``, experts stacked into one ``[experts, rows, cols]`` tensor per projection, the
linear-attention layers of Qwen3-Next / Qwen3.5 as conversion/qwen.py writes them (``_linear_attention``),
and LFM2's as conversion/lfm2.py does (KV heads per layer, the MLP width adjusted, the conv kernel squeezed)."""
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
    "nemotron_h": MODEL_ARCH.NEMOTRON_H,  # nemotron_h_moe where it has experts (_nemotron_h_moe)
    "granitemoehybrid": MODEL_ARCH.GRANITE_HYBRID,
    "gemma4_text": MODEL_ARCH.GEMMA4,
    "lfm2": MODEL_ARCH.LFM2,
    "lfm2_moe": MODEL_ARCH.LFM2MOE,
}
HYBRID = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
LFM2 = ("lfm2", "lfm2_moe")
# What the converter writes for Qwen3.5 when a checkpoint's rope parameters have no mrope_section.
_QWEN35_DEFAULT_MROPE_SECTION = [11, 11, 10, 0]
FULL_ATTENTION = "full_attention"
_EXPERT = re.compile(r"^(model\.layers\.\d+\.(?:mlp|block_sparse_moe|feed_forward)\.experts)\.(\d+)\.(\w+)\.weight$")


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


def _lfm2_ff_dim(config: PretrainedConfig) -> int:
    """conversion/lfm2.py's _add_feed_forward_length: the MLP width as the file states it."""
    ff_dim = config.intermediate_size
    if config.block_auto_adjust_ff_dim:
        ff_dim = int(2 * ff_dim / 3)
        if config.block_ffn_dim_multiplier is not None:
            ff_dim = int(config.block_ffn_dim_multiplier * ff_dim)
        ff_dim = config.block_multiple_of * ((ff_dim + config.block_multiple_of - 1) // config.block_multiple_of)
    return ff_dim


def _mamba2(name: str, t: torch.Tensor, module: str, num_groups: int) -> tuple[str, torch.Tensor]:
    """A tensor of the Mamba-2 mixer under ``module`` as conversion's Mamba2Model writes it (the base
    of Granite 4.0-H's and Nemotron-H's converters): A_log as -exp(A_log), A and D as [heads, 1],
    dt_bias as dt_proj.bias, the conv kernel squeezed, the gated norm as [groups, channels per group]."""
    if name.endswith(f".{module}.A_log"):
        t = -torch.exp(t).reshape(-1, 1)
    elif name.endswith(f".{module}.D"):
        t = t.reshape(-1, 1)
    elif name.endswith(f".{module}.dt_bias"):
        name = name.removesuffix(".dt_bias") + ".dt_proj.bias"
    elif name.endswith(f".{module}.conv1d.weight"):
        t = t.squeeze(1)
    elif name.endswith(f".{module}.norm.weight"):
        t = t.reshape(num_groups, -1)
    return name, t


def _granite_hybrid(name: str, t: torch.Tensor, config: PretrainedConfig) -> list[tuple[str, torch.Tensor]]:
    """A Granite 4.0-H tensor as conversion/granite.py's GraniteHybridModel writes it: (HF-style
    name for TensorNameMap, or a GGUF name, tensor). Its Mamba2Model base (:func:`_mamba2`);
    GraniteMoeModel: the fused gate/up halves apart, the shared MLP as ffn_*_shexp beside experts,
    else as the dense ffn_*; llama's q/k permutation."""
    layer = name.split(".")[2] if name.startswith("model.layers.") else ""
    experts = bool(config.num_local_experts)
    if name.endswith("block_sparse_moe.input_linear.weight"):
        gate, up = t.split(config.intermediate_size, dim=-2)
        return [(f"blk.{layer}.ffn_gate_exps.weight", gate), (f"blk.{layer}.ffn_up_exps.weight", up)]
    if name.endswith("shared_mlp.input_linear.weight"):
        gate, up = t.split(config.shared_intermediate_size, dim=-2)
        suffix = "_shexp" if experts else ""
        return [(f"blk.{layer}.ffn_gate{suffix}.weight", gate), (f"blk.{layer}.ffn_up{suffix}.weight", up)]
    if name.endswith("shared_mlp.output_linear.weight"):
        return [(f"blk.{layer}.ffn_down{'_shexp' if experts else ''}.weight", t)]
    if name.endswith("q_proj.weight"):
        t = _permute(t, config.num_attention_heads)
    elif name.endswith("k_proj.weight"):
        t = _permute(t, config.num_key_value_heads)
    else:
        name, t = _mamba2(name, t, "mamba", config.mamba_n_groups)
    return [(name, t)]


def _write_granite_hybrid_metadata(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    """GraniteHybridModel.set_gguf_parameters beyond the common keys: Granite's multipliers (as
    *_scale), the shared MLP's width, the Mamba dims, KV heads per layer (0 on a Mamba layer), and
    RoPE off (rope_finetuned False, a 2**20 context) for every model but Bamba."""
    if not config.num_local_experts:  # TextModel writes a count of 0 too, and the config's top-k
        writer.add_expert_count(0)
        writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_vocab_size(config.vocab_size)
    writer.add_attention_scale(config.attention_multiplier)
    writer.add_embedding_scale(config.embedding_multiplier)
    writer.add_residual_scale(config.residual_multiplier)
    writer.add_logit_scale(config.logits_scaling)
    writer.add_expert_shared_feed_forward_length(config.shared_intermediate_size)
    writer.add_ssm_conv_kernel(config.mamba_d_conv)
    writer.add_ssm_state_size(config.mamba_d_state)
    writer.add_ssm_group_count(config.mamba_n_groups)
    writer.add_ssm_inner_size(config.mamba_expand * config.hidden_size)
    writer.add_ssm_time_step_rank(config.mamba_n_heads)
    attention = [t in ("attention", "full_attention") for t in config.layer_types]
    writer.add_head_count_kv([config.num_key_value_heads if a else 0 for a in attention])
    writer.add_rope_scaling_finetuned(False)
    writer.add_context_length(2**20)


def _nemotron_h_moe(config: PretrainedConfig) -> bool:
    """conversion/nemotron.py writes a checkpoint with routed experts (num_experts_per_tok in its
    config.json) as nemotron_h_moe; transformers saves that field for every Nemotron-H, so here the
    blocks decide."""
    return config.model_type == "nemotron_h" and "moe" in config.layers_block_type


def _nemotron_h(name: str, t: torch.Tensor, config: PretrainedConfig) -> tuple[str, torch.Tensor]:
    """A Nemotron-H tensor as conversion/nemotron.py's NemotronHModel writes it (HF-style name for
    TensorNameMap): its Mamba2Model base (:func:`_mamba2`); llama's q/k permutation; the routing bias
    as e_score_correction.bias; experts under the names the stacking takes."""
    if ".mixer.experts." in name:
        return name.replace("backbone.", "model.", 1).replace(".mixer.experts.", ".mlp.experts."), t
    if name.endswith(".mixer.q_proj.weight"):
        t = _permute(t, config.num_attention_heads)
    elif name.endswith(".mixer.k_proj.weight"):
        t = _permute(t, config.num_key_value_heads)
    elif name.endswith(".e_score_correction_bias"):
        name = name.removesuffix("_bias") + ".bias"
    else:
        name, t = _mamba2(name, t, "mixer", config.n_groups)
    return name, t


def _write_gemma4(model_dir: Path, config: PretrainedConfig, path: Path, qtype: GGMLQuantizationType) -> Path:
    """conversion/gemma.py's Gemma4Model: the full layers' head size as key_length and the sliding
    layers' as key_length_swa, the layer pattern, the shared-KV layer count, the per-layer input
    width, per-layer MLP widths with a double-wide MLP, KV heads per layer where full layers have
    their own count, both RoPE bases, and proportional RoPE as rope_freqs (1 for rotated pairs,
    1e30 for the rest); norms stored as they are, layer_scalar as layer_output_scale."""
    read = config._getattr_without_heterogeneous_validation
    head_full, head_swa = config.per_layer_config[FULL_ATTENTION].head_dim, read("head_dim")
    swa = [t == "sliding_attention" for t in config.layer_types]
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[MODEL_ARCH.GEMMA4])
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    first_shared = config.num_hidden_layers - config.num_kv_shared_layers
    ff = config.intermediate_size
    if config.use_double_wide_mlp:
        writer.add_feed_forward_length([ff if i < first_shared else 2 * ff for i in range(config.num_hidden_layers)])
    else:
        writer.add_feed_forward_length(ff)
    writer.add_head_count(config.num_attention_heads)
    kv_swa, kv_full = read("num_key_value_heads"), config.per_layer_config[FULL_ATTENTION].num_key_value_heads
    writer.add_head_count_kv([kv_swa if s else kv_full for s in swa] if kv_full != kv_swa else kv_swa)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(head_full)
    writer.add_value_length(head_full)
    writer.add_key_length_swa(head_swa)
    writer.add_value_length_swa(head_swa)
    full_rope, swa_rope = config.rope_parameters[FULL_ATTENTION], config.rope_parameters["sliding_attention"]
    writer.add_rope_freq_base(full_rope["rope_theta"])
    writer.add_rope_freq_base_swa(swa_rope["rope_theta"])
    writer.add_rope_dimension_count(head_full)
    writer.add_rope_dimension_count_swa(head_swa)
    writer.add_sliding_window(config.sliding_window)
    writer.add_sliding_window_pattern(swa)
    writer.add_shared_kv_layers(config.num_kv_shared_layers)
    writer.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input or 0)
    if config.final_logit_softcapping:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if config.enable_moe_block:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.top_k_experts)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    rotated = int(head_full * full_rope["partial_rotary_factor"] / 2)
    tensors = {"rope_freqs.weight": torch.tensor([1.0] * rotated + [1e30] * (head_full // 2 - rotated))}
    for name, t in load_file(str(model_dir / "model.safetensors")).items():
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        if name.endswith("router.scale"):  # Gemma4Model.modify_tensors: the router's scales by llama.cpp's names
            name = f"blk.{layer}.ffn_gate_inp.scale"
        elif name.endswith("router.per_expert_scale"):
            name = f"blk.{layer}.ffn_down_exps.scale"
        elif name.endswith(("layer_scalar", "experts.gate_up_proj", "experts.down_proj")):  # filter_tensors
            name += ".weight"
        tensors[name] = t
    name_map = TensorNameMap(MODEL_ARCH.GEMMA4, config.num_hidden_layers)
    return _write_vocab_and_tensors(writer, config, tensors, name_map, qtype, path)


def _write_nemotron_h_metadata(writer: gguf.GGUFWriter, config: PretrainedConfig, moe: bool) -> None:
    """NemotronHModel.set_gguf_parameters and its bases' keys as the file ends up with them: a 2**20
    context (no RoPE), the feed-forward length and KV heads per layer (0 elsewhere: llama.cpp tells the
    blocks apart by them), layer_norm_epsilon, the rope dims hidden / heads (GraniteModel drops
    head_dim; key_length keeps it), the Mamba dims, and the experts' routing."""
    types = list(config.layers_block_type)
    n_ff = config.moe_intermediate_size if moe else config.intermediate_size
    writer.add_block_count(len(types))
    writer.add_context_length(2**20)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length([n_ff if t == ("moe" if moe else "mlp") else 0 for t in types])
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv([config.num_key_value_heads if t == "full_attention" else 0 for t in types])
    writer.add_layer_norm_eps(config.layer_norm_epsilon)
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_ssm_conv_kernel(config.conv_kernel)
    writer.add_ssm_state_size(config.ssm_state_size)
    writer.add_ssm_group_count(config.n_groups)
    writer.add_ssm_inner_size(config.mamba_num_heads * config.mamba_head_dim)
    writer.add_ssm_time_step_rank(config.mamba_num_heads)
    writer.add_rope_scaling_finetuned(False)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    if moe:
        writer.add_expert_count(config.n_routed_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_group_count(config.n_group)
        writer.add_expert_group_used_count(config.topk_group)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_feed_forward_length(config.moe_shared_expert_intermediate_size)
        writer.add_expert_shared_count(config.n_shared_experts)
        writer.add_expert_weights_norm(config.norm_topk_prob)
        writer.add_expert_weights_scale(config.routed_scaling_factor)


def _tensors(model_dir: Path, config: PretrainedConfig) -> dict[str, torch.Tensor]:
    weights = load_file(str(model_dir / "model.safetensors"))
    experts: dict[str, dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        if config.model_type == "nemotron_h":
            name, t = _nemotron_h(name, t, config)
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
        if config.model_type == "granitemoehybrid":
            out.update(_granite_hybrid(name, t, config))
            continue
        if config.model_type in LFM2:  # conversion/lfm2.py: the conv kernel squeezed, expert_bias as a bias
            t = t.squeeze(1) if "conv.conv" in name else t
            name = name.replace(".expert_bias", ".expert_bias.bias") if name.endswith(".expert_bias") else name
        out[name] = t
    for name, parts in experts.items():
        # LFM2-MoE's converter names the stacked experts without "model." (as TensorNameMap knows them).
        out[name.removeprefix("model.") if config.model_type in LFM2 else name] = torch.stack([parts[e] for e in sorted(parts)])
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
    if config.model_type == "gemma4_text":  # per-layer head sizes: keys of its own
        return _write_gemma4(model_dir, config, path, qtype)
    arch = MODEL_ARCH.NEMOTRON_H_MOE if _nemotron_h_moe(config) else ARCHS[config.model_type]
    name_map = TensorNameMap(arch, config.num_hidden_layers + mtp_layers)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    if config.model_type == "nemotron_h":  # no RoPE, no rms_norm_eps: its own keys
        _write_nemotron_h_metadata(writer, config, arch == MODEL_ARCH.NEMOTRON_H_MOE)
        return _write_vocab_and_tensors(writer, config, _tensors(model_dir, config), name_map, qtype, path)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers + mtp_layers)
    if mtp_layers:
        writer.add_nextn_predict_layers(mtp_layers)
    if getattr(config, "intermediate_size", None) and config.model_type != "lfm2":  # Qwen3.5-MoE has none; LFM2's below
        writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    if config.model_type in LFM2:  # conversion/lfm2.py: KV heads per layer (0: conv), no head_dim keys
        writer.add_head_count_kv([config.num_key_value_heads if t != "conv" else 0 for t in config.layer_types])
        writer.add_layer_norm_rms_eps(config.norm_eps)
        writer.add_shortconv_l_cache(config.conv_L_cache)
        writer.add_vocab_size(config.vocab_size)
        if config.model_type == "lfm2":
            writer.add_feed_forward_length(_lfm2_ff_dim(config))
        else:
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
            writer.add_leading_dense_block_count(config.num_dense_layers)
            writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    else:
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        if config.model_type != "granitemoehybrid":  # conversion/granite.py drops head_dim
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
    if config.model_type not in LFM2:  # conversion/lfm2.py writes no rotary width
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
    if config.model_type == "granitemoehybrid":
        _write_granite_hybrid_metadata(writer, config)
    tensors = _converter_options(_tensors(model_dir, config), config, fuse_qkv, fuse_gate_up_exps, mtp_layers)
    return _write_vocab_and_tensors(writer, config, tensors, name_map, qtype, path)


def _write_vocab_and_tensors(
    writer: gguf.GGUFWriter, config: PretrainedConfig, tensors: dict[str, torch.Tensor], name_map: TensorNameMap,
    qtype: GGMLQuantizationType, path: Path,
) -> Path:
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
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
