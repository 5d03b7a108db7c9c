"""Mixtral: Mistral's attention with a routed mixture of experts (``block_sparse_moe``) in every
layer; each expert's w1/w3 (gate/up) load as one fused projection, w2 as its down projection."""
from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from pagellm.layers.activation import canonical_activation
from pagellm.layers.moe import FusedMoE
from pagellm.models.decoder import LLAMA_STACKED_PARAMS
from pagellm.models.llama import MistralForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class MixtralForCausalLM(MistralForCausalLM):
    stacked_params = LLAMA_STACKED_PARAMS + (
        ("gate_up_proj", "w1", "gate"),
        ("gate_up_proj", "w3", "up"),
        ("down_proj", "w2", None),
    )
    mlp_name = "block_sparse_moe"

    def make_mlp(self, hf_config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return FusedMoE(
            hf_config.hidden_size,
            hf_config.num_local_experts,
            hf_config.num_experts_per_tok,
            hf_config.intermediate_size,
            canonical_activation(getattr(hf_config, "hidden_act", "silu")),
            renormalize=True,
        )
