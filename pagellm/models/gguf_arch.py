"""What each GGUF architecture (llama.cpp's name for it) is here: its transformers model type and
class, the metadata keys beyond transformers' own GGUF mapping, and its tensor names. The
recurrent hybrids' tables and config finishers are gguf_hybrid_arch's, merged in here.

Tensor names are llama.cpp's (gguf-py's ``TENSOR_NAMES``); each maps to the Hugging Face name our
model classes load. llama.cpp stores a mixture of experts as one ``[experts, rows, cols]`` tensor
per projection (``ffn_gate_exps``...), which is yielded as each expert's rows (views, no copy).
"""
from __future__ import annotations

from typing import Any

from pagellm.models.gguf_hybrid_arch import HYBRID_GGUF_ARCHS, finish_hybrid_config
from pagellm.models.gguf_names import MIXTRAL_EXPERTS, MOE_KEYS, QWEN_EXPERTS, GGUFArch

LLAMA_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


GGUF_ARCHS: dict[str, GGUFArch] = {
    "llama": GGUFArch("llama", "LlamaForCausalLM", "llama"),
    "mistral": GGUFArch("mistral", "MistralForCausalLM", "mistral"),
    "qwen2": GGUFArch("qwen2", "Qwen2ForCausalLM", "qwen2"),
    "qwen3": GGUFArch("qwen3", "Qwen3ForCausalLM", "qwen3", extra_keys={"attention.key_length": "head_dim"}),
    "qwen3moe": GGUFArch(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        extra_keys={**MOE_KEYS, "expert_feed_forward_length": "moe_intermediate_size"},
        block_names={"ffn_gate_inp": "mlp.gate"},
        moe_module="mlp",
        expert_names=QWEN_EXPERTS,
    ),
    "gemma3": GGUFArch(
        "gemma3_text",
        "Gemma3ForCausalLM",
        "gemma3",
        extra_keys={"final_logit_softcapping": "final_logit_softcapping", "rope.scaling.factor": "rope_scaling_factor"},
        block_names={
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
        norm_shift=1.0,
    ),
    # Gemma 4: the full layers' head size is key_length, the sliding layers' key_length_swa.
    "gemma4": GGUFArch(
        "gemma4_text",
        "Gemma4ForCausalLM",
        "gemma3",
        extra_keys={
            "final_logit_softcapping": "final_logit_softcapping",
            "attention.key_length": "global_head_dim",
            "attention.key_length_swa": "head_dim",
            "attention.sliding_window_pattern": "sliding_window_pattern",
            "attention.shared_kv_layers": "num_kv_shared_layers",
            "embedding_length_per_layer_input": "hidden_size_per_layer_input",
            "rope.freq_base_swa": "rope_theta_swa",
            "expert_count": "num_experts",
            "expert_used_count": "top_k_experts",
            "expert_feed_forward_length": "moe_intermediate_size",
        },
        block_names={
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
            "inp_gate": "per_layer_input_gate",
            "proj": "per_layer_projection",
            "post_norm": "post_per_layer_input_norm",
            "layer_output_scale": "layer_scalar",
            # The 26B-A4B's experts beside the dense MLP: one module here (models/gemma4.py's Gemma4MoE).
            "pre_ffw_norm_2": "pre_feedforward_layernorm_2",
            "post_ffw_norm_1": "post_feedforward_layernorm_1",
            "post_ffw_norm_2": "post_feedforward_layernorm_2",
            "ffn_gate_inp": "moe.proj",
            "ffn_gate_inp.scale": "moe",
            "ffn_down_exps.scale": "moe",
        },
        suffixless={"ffn_gate_inp.scale": "scale", "ffn_down_exps.scale": "per_expert_scale"},
        moe_module="moe",
        expert_names=QWEN_EXPERTS,
        top_level_names={
            "per_layer_token_embd": "model.embed_tokens_per_layer",
            "per_layer_model_proj": "model.per_layer_model_projection",
            "per_layer_proj_norm": "model.per_layer_projection_norm",
        },
    ),
    "phi3": GGUFArch(
        "phi3",
        "Phi3ForCausalLM",
        "phi3",
        extra_keys={
            "attention.sliding_window": "sliding_window",
            "rope.dimension_count": "rotary_dim",
            "rope.scaling.original_context_length": "original_max_position_embeddings",
        },
        # llama.cpp keeps Phi-3's fused projections fused; ffn_up holds gate and up rows.
        block_names={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    ),
    "gpt-oss": GGUFArch(
        "gpt_oss",
        "GptOssForCausalLM",
        "gpt_oss",
        extra_keys={
            "attention.key_length": "head_dim",
            "attention.sliding_window": "sliding_window",
            "expert_feed_forward_length": "intermediate_size",
            "rope.scaling.factor": "rope_scaling_factor",
            "rope.scaling.original_context_length": "rope_original_context",
        },
        block_names={"post_attention_norm": "post_attention_layernorm", "attn_sinks": "self_attn", "ffn_gate_inp": "mlp.router"},
        moe_module="mlp",
        expert_names=QWEN_EXPERTS,
    ),
    **HYBRID_GGUF_ARCHS,
}
# GGUF block tensors whose HF name has no ".weight" (gpt-oss's sinks are a parameter of self_attn,
# A_log and dt_bias of a linear-attention module).
SUFFIXLESS = {"attn_sinks": "sinks", "ssm_a": "A_log", "ssm_dt": "dt_bias"}
# A llama-architecture file with experts is Mixtral (llama.cpp converts Mixtral as "llama").
MIXTRAL = GGUFArch(
    "mixtral",
    "MixtralForCausalLM",
    "llama",
    extra_keys={"expert_count": "num_local_experts", "expert_used_count": "num_experts_per_tok"},
    block_names={"ffn_gate_inp": "block_sparse_moe.gate"},
    moe_module="block_sparse_moe",
    expert_names=MIXTRAL_EXPERTS,
)


def arch_of(architecture: str, metadata: dict[str, Any]) -> GGUFArch:
    """The :class:`GGUFArch` of a file; ValueError naming the supported ones otherwise."""
    if architecture not in GGUF_ARCHS:
        raise ValueError(f"GGUF architecture {architecture!r} is not supported; supported: {', '.join(sorted(GGUF_ARCHS))}.")
    if architecture == "llama" and int(metadata.get("llama.expert_count", 0) or 0) > 0:
        return MIXTRAL
    return GGUF_ARCHS[architecture]


def finish_config(arch: GGUFArch, values: dict[str, Any]) -> dict[str, Any]:
    """Fields llama.cpp leaves implicit for the architectures built on transformers' own config
    classes (what llama.cpp's own loader assumes for the same file)."""
    values = dict(values)
    head_dim = values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
    values["head_dim"] = head_dim
    theta = float(values.pop("rope_theta", 10000.0))
    if arch.model_type == "gemma3_text":
        # llama.cpp: sliding layers rotate with base 10,000, five sliding to one global, and the
        # query scale is 1/sqrt(head_dim) (1/sqrt(hidden / heads) for the 62-layer 27B).
        values["rope_parameters"] = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": theta},
        }
        factor = values.pop("rope_scaling_factor", None)
        if factor and float(factor) != 1.0:
            values["rope_parameters"]["full_attention"] = {"rope_type": "linear", "factor": float(factor), "rope_theta": theta}
        big = values["num_hidden_layers"] == 62
        values["query_pre_attn_scalar"] = values["hidden_size"] // values["num_attention_heads"] if big else head_dim
        values.setdefault("sliding_window_pattern", 6)
        values["layer_types"] = [
            "full_attention" if (i + 1) % values["sliding_window_pattern"] == 0 else "sliding_attention"
            for i in range(values["num_hidden_layers"])
        ]
        values["tie_word_embeddings"] = True
    elif arch.model_type == "gemma4_text":
        _finish_gemma4(values, theta)
    elif arch.model_type == "phi3":
        rotary_dim = values.pop("rotary_dim", None) or head_dim
        values["rope_parameters"] = {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": rotary_dim / head_dim}
        long, short = values.pop("rope_long_factor", None), values.pop("rope_short_factor", None)
        if long is not None and short is not None:  # LongRoPE: llama.cpp stores the factors as tensors
            values["rope_parameters"].update(
                rope_type="longrope",
                long_factor=long,
                short_factor=short,
                original_max_position_embeddings=values.get("original_max_position_embeddings", values["max_position_embeddings"]),
            )
        if not values.get("sliding_window"):  # llama.cpp writes 0 for none
            values["sliding_window"] = None
    elif not finish_hybrid_config(arch, values, theta):  # the hybrids' own, else plain RoPE
        values["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    if arch.model_type == "gpt_oss":
        # llama.cpp: YaRN from the file, a window on every other layer from the first.
        factor, original = values.pop("rope_scaling_factor", None), values.pop("rope_original_context", None)
        if factor:
            values["rope_parameters"] = {
                "rope_type": "yarn",
                "factor": float(factor),
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": int(original or values["max_position_embeddings"]),
                "rope_theta": theta,
            }
        values["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(values["num_hidden_layers"])]
    if arch.model_type == "qwen3_moe":
        # llama.cpp renormalises Qwen3-MoE's top-k weights and puts experts in every layer.
        values.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    if arch.model_type == "mixtral":
        values.setdefault("sliding_window", None)
    return values


def _finish_gemma4(values: dict[str, Any], theta: float) -> None:
    """Gemma 4: layer kinds from the file's pattern, plain RoPE on sliding layers and proportional
    on full ones (its share from rope_freqs), and where the file lists a value per layer: the MLP
    width (wider: use_double_wide_mlp) and the full layers' KV heads."""
    values["enable_moe_block"] = bool(values.get("num_experts"))
    kinds = ["sliding_attention" if s else "full_attention" for s in values.pop("sliding_window_pattern")]
    values["layer_types"] = kinds
    values["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default", "rope_theta": float(values.pop("rope_theta_swa", 10000.0))},
        "full_attention": {
            "rope_type": "proportional", "partial_rotary_factor": values.pop("rope_partial_rotary_factor"), "rope_theta": theta
        },
    }
    widths = values.get("intermediate_size")
    if isinstance(widths, list):
        values["intermediate_size"], values["use_double_wide_mlp"] = min(widths), max(widths) != min(widths)
    kv_heads = values.get("num_key_value_heads")
    if isinstance(kv_heads, list):
        values["num_key_value_heads"] = kv_heads[kinds.index("sliding_attention")]
        values["num_global_key_value_heads"] = kv_heads[kinds.index("full_attention")]
