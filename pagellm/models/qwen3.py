"""Qwen3 (dense) and Qwen3-MoE: Llama's layout with a per-head RMSNorm on q and k before rotary,
and, for the MoE models, a routed mixture of experts in place of the MLP on the sparse layers."""
from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from pagellm.layers.activation import canonical_activation
from pagellm.layers.moe import FusedMoE
from pagellm.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def bias_flags(hf_config: PretrainedConfig) -> tuple[bool, bool, bool]:
        return bool(getattr(hf_config, "attention_bias", False)), bool(getattr(hf_config, "attention_bias", False)), False

    def attention_extra(self, hf_config: PretrainedConfig) -> dict:
        return {"qk_norm": True, "qk_norm_eps": hf_config.rms_norm_eps}


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @staticmethod
    def is_sparse(hf_config: PretrainedConfig, layer_idx: int) -> bool:
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        only_mlp = getattr(hf_config, "mlp_only_layers", None) or []
        return layer_idx not in only_mlp and hf_config.num_experts > 0 and (layer_idx + 1) % step == 0

    def make_mlp(self, hf_config: PretrainedConfig, layer_idx: int) -> nn.Module:
        if not self.is_sparse(hf_config, layer_idx):
            return super().make_mlp(hf_config, layer_idx)
        return FusedMoE(
            hf_config.hidden_size,
            hf_config.num_experts,
            hf_config.num_experts_per_tok,
            hf_config.moe_intermediate_size,
            canonical_activation(getattr(hf_config, "hidden_act", "silu")),
            renormalize=bool(getattr(hf_config, "norm_topk_prob", True)),
        )
