"""The GGUF names, metadata keys and config finishers of the recurrent hybrid architectures (those
with layers that keep a state slot): Qwen3-Next and Qwen3.5, LFM2 and LFM2-MoE (short convolutions),
Granite 4.0-H and Nemotron-H (Mamba-2 mixers). gguf_arch merges :data:`HYBRID_GGUF_ARCHS` into its
``GGUF_ARCHS`` and calls :func:`finish_hybrid_config` from ``finish_config``.

Qwen3-Next and Qwen3.5 (``qwen3next``, ``qwen35``, ``qwen35moe``) mix full attention with gated
delta-net linear attention; the converter rewrites those layers' tensors (their inverse is
gguf_loader's ``_LinearAttentionLayout``): ``A_log`` is stored as ``ssm_a = -exp(A_log)``, the conv
kernel squeezed to ``[channels, kernel]``, every RMSNorm but the gated one as ``1 + w``; Qwen3-Next's
``in_proj_qkvz`` (q, k, v, z interleaved per key head) is split into ``attn_qkv`` (all q, all k, all
v) and ``attn_gate`` (z); Qwen3.5's value heads, where there are more than key heads, are reordered
from grouped by key head to tiled (q/k/v rows, z rows, b/a rows, A, dt, conv channels, out columns).
"""
from __future__ import annotations

from typing import Any

from pagellm.models.gguf_names import MIXTRAL_EXPERTS, MOE_KEYS, QWEN_EXPERTS, GGUFArch

# Qwen3-Next / Qwen3.5: the linear-attention dims (llama.cpp's ssm_* keys) and the layer pattern.
_HYBRID_KEYS = {
    "attention.key_length": "head_dim",
    "rope.dimension_count": "rotary_dim",
    "rope.dimension_sections": "mrope_section",
    "ssm.conv_kernel": "linear_conv_kernel_dim",
    "ssm.state_size": "linear_key_head_dim",
    "ssm.group_count": "linear_num_key_heads",
    "ssm.time_step_rank": "linear_num_value_heads",
    "ssm.inner_size": "ssm_inner_size",  # value heads x value head dim
    "full_attention_interval": "full_attention_interval",
    "attention.recurrent_layers": "recurrent_layers",
    "nextn_predict_layers": "nextn_predict_layers",  # MTP blocks appended after the trunk's
}
_HYBRID_MOE_KEYS = {
    **_HYBRID_KEYS,
    **MOE_KEYS,
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}
_HYBRID_NAMES = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",  # a full-attention layer's fused q/k/v where --fuse-qkv made one
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_in": "linear_attn.in_proj_qkvz",  # Qwen3-Next files of older converters: the HF tensor as is
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_a": "linear_attn",  # .A_log (SUFFIXLESS)
    "ssm_dt": "linear_attn",  # .dt_bias (SUFFIXLESS)
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
}
_SHARED_EXPERT_NAMES = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}


# LFM2 / LFM2-MoE: llama.cpp's shortconv tensors (the conv kernel squeezed to [channels, kernel]),
# its attention's names, operator_norm as attn_norm, the MoE's expert_bias as exp_probs_b.bias.
_LFM2_NAMES = {
    "attn_norm": "operator_norm",
    "ffn_norm": "ffn_norm",
    "attn_output": "self_attn.out_proj",
    "attn_q_norm": "self_attn.q_layernorm",
    "attn_k_norm": "self_attn.k_layernorm",
    "shortconv.conv": "conv.conv",
    "shortconv.in_proj": "conv.in_proj",
    "shortconv.out_proj": "conv.out_proj",
    "ffn_gate": "feed_forward.w1",
    "ffn_up": "feed_forward.w3",
    "ffn_down": "feed_forward.w2",
    "ffn_gate_inp": "feed_forward.gate",
    "exp_probs_b": "feed_forward",  # .expert_bias (suffixless)
}
_LFM2_KEYS = {"attention.layer_norm_rms_epsilon": "norm_eps"}


def _lfm2(moe: bool) -> GGUFArch:
    return GGUFArch(
        "lfm2_moe" if moe else "lfm2",
        "Lfm2MoeForCausalLM" if moe else "Lfm2ForCausalLM",
        "lfm2",
        extra_keys={
            **_LFM2_KEYS,
            **({**MOE_KEYS, "expert_feed_forward_length": "moe_intermediate_size", "leading_dense_block_count": "num_dense_layers"}
               if moe else {}),
        },
        block_names=_LFM2_NAMES,
        moe_module="feed_forward" if moe else None,
        expert_names=MIXTRAL_EXPERTS if moe else {},
        top_level_names={"token_embd_norm": "model.embedding_norm"},
        suffixless={"exp_probs_b": "expert_bias"},
    )


# A Mamba-2 mixer's tensors (conversion's Mamba2Model, the base of Granite 4.0-H's and Nemotron-H's) under
# the HF module that holds it: dt_bias, A and D are parameters of the module itself.
_MAMBA2_SUFFIXLESS = {"ssm_a": "A", "ssm_d": "D"}  # beside SUFFIXLESS's ssm_dt -> dt_bias


def _mamba2_names(module: str) -> dict[str, str]:
    return {
        "ssm_in": f"{module}.in_proj",
        "ssm_conv1d": f"{module}.conv1d",
        "ssm_dt": module,
        "ssm_a": module,
        "ssm_d": module,
        "ssm_norm": f"{module}.norm",
        "ssm_out": f"{module}.out_proj",
    }


# Granite 4.0-H (granitehybrid): conversion/granite.py's GraniteHybridModel on its Mamba2Model base:
# ssm_a is -exp(A_log) as [heads, 1], ssm_d [heads, 1], the conv kernel squeezed, ssm_norm as
# [groups, channels per group]; the shared MLP is ffn_*_shexp beside experts, else ffn_*; a layer with
# no KV heads is a Mamba layer; rope.scaling.finetuned says whether attention rotates.
_GRANITE_HYBRID_NAMES = {
    **_mamba2_names("mamba"),
    "ffn_gate_inp": "block_sparse_moe.router",
    "ffn_gate": "shared_mlp.gate_proj",
    "ffn_up": "shared_mlp.up_proj",
    "ffn_down": "shared_mlp.down_proj",
    "ffn_gate_shexp": "shared_mlp.gate_proj",
    "ffn_up_shexp": "shared_mlp.up_proj",
    "ffn_down_shexp": "shared_mlp.down_proj",
}
_GRANITE_HYBRID_KEYS = {
    **MOE_KEYS,
    "expert_count": "num_local_experts",
    "expert_shared_feed_forward_length": "shared_intermediate_size",
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "attention.scale": "attention_multiplier",
    "logit_scale": "logits_scaling",
    "rope.scaling.finetuned": "rope_finetuned",
    "ssm.conv_kernel": "mamba_d_conv",
    "ssm.state_size": "mamba_d_state",
    "ssm.group_count": "mamba_n_groups",
    "ssm.time_step_rank": "mamba_n_heads",
    "ssm.inner_size": "mamba_inner_size",
}


# Nemotron-H (nemotron_h, nemotron_h_moe; conversion/nemotron.py on the same Mamba2Model base): one
# mixer per block under mixer.*, its norm as attn_norm; the experts plain MLPs (ffn_up_exps and
# ffn_down_exps), the routing bias as exp_probs_b.bias. Blocks are told apart by the per-layer KV
# heads and feed-forward lengths (neither: Mamba-2), as llama.cpp does.
_NEMOTRON_H_NAMES = {
    "attn_norm": "norm",
    "attn_q": "mixer.q_proj",
    "attn_k": "mixer.k_proj",
    "attn_v": "mixer.v_proj",
    "attn_output": "mixer.o_proj",
    "ffn_up": "mixer.up_proj",
    "ffn_down": "mixer.down_proj",
    **_mamba2_names("mixer"),
    "ffn_gate_inp": "mixer.gate",
    "exp_probs_b": "mixer",  # .e_score_correction_bias (suffixless)
    "ffn_up_shexp": "mixer.shared_experts.up_proj",
    "ffn_down_shexp": "mixer.shared_experts.down_proj",
}
_NEMOTRON_H_KEYS = {
    "attention.key_length": "head_dim",
    "attention.layer_norm_epsilon": "layer_norm_epsilon",
    "ssm.conv_kernel": "conv_kernel",
    "ssm.state_size": "ssm_state_size",
    "ssm.group_count": "n_groups",
    "ssm.time_step_rank": "mamba_num_heads",
    "ssm.inner_size": "mamba_inner_size",
    "nextn_predict_layers": "nextn_predict_layers",  # an MTP block after the trunk's
}
_NEMOTRON_H_MOE_KEYS = {
    **_NEMOTRON_H_KEYS,
    "expert_count": "n_routed_experts",
    "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "moe_shared_expert_intermediate_size",
    "expert_shared_count": "n_shared_experts",
    "expert_weights_norm": "norm_topk_prob",
    "expert_weights_scale": "routed_scaling_factor",
    "expert_group_count": "n_group",
    "expert_group_used_count": "topk_group",
    "moe_latent_size": "moe_latent_size",
}


def _nemotron_h(moe: bool) -> GGUFArch:
    return GGUFArch(
        "nemotron_h",
        "NemotronHForCausalLM",
        "qwen3",  # transformers' mapping has no Nemotron-H: the common keys
        extra_keys=_NEMOTRON_H_MOE_KEYS if moe else _NEMOTRON_H_KEYS,
        block_names=_NEMOTRON_H_NAMES,
        moe_module="mixer" if moe else None,
        expert_names={"ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"} if moe else {},
        suffixless={**_MAMBA2_SUFFIXLESS, "exp_probs_b": "e_score_correction_bias"},
    )


def _hybrid(model_type: str, architecture: str, layout: str, moe: bool) -> GGUFArch:
    return GGUFArch(
        model_type,
        architecture,
        "qwen3_moe" if moe else "qwen3",
        extra_keys=_HYBRID_MOE_KEYS if moe else _HYBRID_KEYS,
        block_names={**_HYBRID_NAMES, **(_SHARED_EXPERT_NAMES if moe else {})},
        norm_shift=1.0,
        moe_module="mlp" if moe else None,
        expert_names=QWEN_EXPERTS if moe else {},
        plain_norms=frozenset({"ssm_norm"}),
        linear_attention=layout,
    )


HYBRID_GGUF_ARCHS: dict[str, GGUFArch] = {
    "qwen3next": _hybrid("qwen3_next", "Qwen3NextForCausalLM", "qwen3next", moe=True),
    "qwen35": _hybrid("qwen3_5_text", "Qwen3_5ForCausalLM", "qwen35", moe=False),
    "qwen35moe": _hybrid("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", "qwen35", moe=True),
    "granitehybrid": GGUFArch(
        "granitemoehybrid",
        "GraniteMoeHybridForCausalLM",
        "qwen3",  # transformers' mapping has no Granite: the common keys
        extra_keys=_GRANITE_HYBRID_KEYS,
        block_names=_GRANITE_HYBRID_NAMES,
        moe_module="block_sparse_moe",
        expert_names=QWEN_EXPERTS,
        suffixless=_MAMBA2_SUFFIXLESS,
    ),
    "lfm2": _lfm2(moe=False),
    "lfm2moe": _lfm2(moe=True),
    "nemotron_h": _nemotron_h(moe=False),
    "nemotron_h_moe": _nemotron_h(moe=True),
}


def finish_hybrid_config(arch: GGUFArch, values: dict[str, Any], theta: float) -> bool:
    """Fill in, in place, the fields llama.cpp leaves implicit for a hybrid architecture; False
    (``values`` untouched) where ``arch`` is not one of :data:`HYBRID_GGUF_ARCHS`."""
    if arch.linear_attention:
        _finish_hybrid(arch, values, theta)
    elif arch.model_type == "granitemoehybrid":
        _finish_granite_hybrid(values, theta)
    elif arch.model_type == "nemotron_h":
        _finish_nemotron_h(arch, values)
    elif arch.model_type in ("lfm2", "lfm2_moe"):
        _finish_lfm2(arch, values, theta)
    else:
        return False
    return True


def _finish_lfm2(arch: GGUFArch, values: dict[str, Any], theta: float) -> None:
    """LFM2 / LFM2-MoE: the conv layers are those with no KV heads; the file's feed-forward length is
    the MLP's width already adjusted; llama.cpp routes LFM2-MoE by sigmoid scores with the expert
    bias, renormalised and unscaled."""
    values["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    kv_heads = values.get("num_key_value_heads")
    per_layer = kv_heads if isinstance(kv_heads, list) else [kv_heads] * values["num_hidden_layers"]
    values["layer_types"] = ["full_attention" if n else "conv" for n in per_layer]
    values["num_key_value_heads"] = max(per_layer)
    values.pop("head_dim", None)  # transformers' LFM2 config has none: hidden / heads
    if arch.model_type == "lfm2":
        values["block_auto_adjust_ff_dim"] = False
    else:
        values.update(norm_topk_prob=True, routed_scaling_factor=1.0, use_expert_bias=True)
        values.setdefault("num_dense_layers", 0)


def _finish_granite_hybrid(values: dict[str, Any], theta: float) -> None:
    """Granite 4.0-H: the Mamba layers are those with no KV heads; the Mamba head dim and expansion
    from the inner size; RoPE only where the file says so (llama.cpp's rope_finetuned); no experts
    where the file counts none."""
    kv_heads = values.get("num_key_value_heads")
    per_layer = kv_heads if isinstance(kv_heads, list) else [kv_heads] * values["num_hidden_layers"]
    values["layer_types"] = ["attention" if n else "mamba" for n in per_layer]
    values["num_key_value_heads"] = max(per_layer)
    inner = int(values.pop("mamba_inner_size"))
    values["mamba_d_head"] = inner // int(values["mamba_n_heads"])
    values["mamba_expand"] = inner // int(values["hidden_size"])
    values["position_embedding_type"] = "rope" if values.pop("rope_finetuned", False) else "nope"
    values["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    values.setdefault("num_local_experts", 0)
    values.pop("head_dim", None)  # transformers' Granite config has none: hidden / heads


def _finish_nemotron_h(arch: GGUFArch, values: dict[str, Any]) -> None:
    """Nemotron-H: each block's kind from the per-layer arrays as llama.cpp reads them (KV heads:
    attention; a feed-forward length: the MLP, or the MoE in nemotron_h_moe; neither: Mamba-2), an
    MTP block after the trunk's dropped, the Mamba head dim from the inner size; no RoPE."""
    num_layers = values["num_hidden_layers"] - int(values.pop("nextn_predict_layers", 0) or 0)

    def per_layer(key: str) -> list[int]:
        value = values.get(key) or 0
        return [int(v) for v in value[:num_layers]] if isinstance(value, list) else [int(value)] * num_layers

    kv_heads, ff = per_layer("num_key_value_heads"), per_layer("intermediate_size")
    ff_kind = "moe" if arch.moe_module else "mlp"
    values["layers_block_type"] = ["full_attention" if h else ff_kind if f else "linear_attention" for h, f in zip(kv_heads, ff)]
    values["num_hidden_layers"] = num_layers
    values["num_key_value_heads"] = max(kv_heads)
    values.pop("intermediate_size", None)
    if max(ff):  # else the config's default: no block reads it
        values["intermediate_size"] = max(ff)
    values["mamba_head_dim"] = int(values.pop("mamba_inner_size")) // int(values["mamba_num_heads"])



def _finish_hybrid(arch: GGUFArch, values: dict[str, Any], theta: float) -> None:
    """Qwen3-Next / Qwen3.5: the trunk's layers (MTP blocks dropped), their kinds, partial rotary
    and the value head dim, as transformers' config holds them (llama.cpp's own defaults where the
    file is silent: a full-attention layer every 4th)."""
    head_dim = values["head_dim"]
    rotary_dim = int(values.pop("rotary_dim", None) or head_dim)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": rotary_dim / head_dim}
    # Qwen3.5 rotates text with interleaved MRoPE (all three positions equal, so plain RoPE); the
    # converter writes transformers' default sections when a checkpoint has none, kept where they fit.
    sections = [int(s) for s in values.pop("mrope_section", None) or []]
    if arch.linear_attention == "qwen35" and sections and sum(sections[:3]) == rotary_dim // 2:
        rope.update(mrope_section=sections[:3], mrope_interleaved=True)
    values["rope_parameters"] = rope
    num_layers = values["num_hidden_layers"] - int(values.pop("nextn_predict_layers", 0) or 0)
    values["num_hidden_layers"] = num_layers
    recurrent = values.pop("recurrent_layers", None)
    interval = int(values.pop("full_attention_interval", None) or 4)
    if recurrent is not None:
        values["layer_types"] = ["linear_attention" if r else "full_attention" for r in recurrent[:num_layers]]
    else:
        values["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    for key in ("num_key_value_heads", "num_attention_heads"):  # per-layer arrays in some files: the attention layers'
        if isinstance(values.get(key), list):
            values[key] = max(values[key])
    inner = values.pop("ssm_inner_size", None)
    if inner and values.get("linear_num_value_heads"):
        values["linear_value_head_dim"] = int(inner) // int(values["linear_num_value_heads"])
    if arch.model_type == "qwen3_next":
        # llama.cpp renormalises the top-k weights and puts experts in every layer.
        values.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
