"""Qwen3.5 (dense and MoE) and Qwen3-Next: hybrids of Gated DeltaNet layers (``linear_attention``,
three in four) and gated full attention (q/k norm, partial rotary, a sigmoid gate from q_proj on
the output). Norms are ``1 + w``. The MoE models route over many small experts beside one shared
expert whose output is scaled by a sigmoid gate. Qwen3-Next stores its linear layers' input
projections interleaved per key head (``in_proj_qkvz``, ``in_proj_ba``), Qwen3.5 apart.

Text only: an image-and-text checkpoint (``Qwen3_5ForConditionalGeneration``) serves its language
model. The recurrent layers keep a state slot per request (pagellm.core.state_cache).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend
from pagellm.layers.activation import canonical_activation
from pagellm.layers.attention import Attention
from pagellm.layers.gated_deltanet import GatedDeltaNet
from pagellm.layers.linear import Linear
from pagellm.layers.mlp import GatedMLP
from pagellm.layers.moe import FusedMoE
from pagellm.models.decoder import LLAMA_STACKED_PARAMS, CausalLM, DecoderLayer, DecoderModel, tp_shard_of
from pagellm.models.llama import attention_spec
from pagellm.models.shape import StateTensorShape

if TYPE_CHECKING:
    from transformers import PretrainedConfig

LINEAR_ATTENTION = "linear_attention"


class SharedExpertMoE(FusedMoE):
    """Routed experts plus a shared expert, ``sigmoid(shared_expert_gate(x))`` times its output."""

    def __init__(self, hf_config: PretrainedConfig) -> None:
        activation = canonical_activation(getattr(hf_config, "hidden_act", "silu"))
        super().__init__(
            hf_config.hidden_size,
            hf_config.num_experts,
            hf_config.num_experts_per_tok,
            hf_config.moe_intermediate_size,
            activation,
            renormalize=bool(getattr(hf_config, "norm_topk_prob", True)),
        )
        self.shared_expert = GatedMLP(hf_config.hidden_size, hf_config.shared_expert_intermediate_size, activation)
        self.shared_expert_gate = Linear(hf_config.hidden_size, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().forward(x) + shared


class Qwen3_5ForCausalLM(CausalLM):
    stacked_params = LLAMA_STACKED_PARAMS + (
        ("in_proj", "in_proj_qkvz", "qkvz"),
        ("in_proj", "in_proj_ba", "ba"),
        ("in_proj", "in_proj_qkv", "qkv"),
        ("in_proj", "in_proj_z", "z"),
        ("in_proj", "in_proj_b", "b"),
        ("in_proj", "in_proj_a", "a"),
    )
    interleaved_projection = False  # Qwen3-Next: in_proj_qkvz / in_proj_ba grouped by key head

    @classmethod
    def recurrent_state(cls, hf_config: PretrainedConfig) -> tuple[tuple[int, ...], tuple[StateTensorShape, ...]]:
        """The Gated DeltaNet layers and their state: the convolution's last K - 1 inputs (q, k and
        v channels) and a ``[Dk, Dv]`` matrix per value head."""
        layer_ids = tuple(i for i, kind in enumerate(hf_config.layer_types) if kind == LINEAR_ATTENTION)
        c = hf_config
        conv_channels = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
        return layer_ids, (
            StateTensorShape((c.linear_conv_kernel_dim - 1, conv_channels), 1, ssm=False),
            StateTensorShape((c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim), 0, ssm=True),
        )

    def make_mlp(self, hf_config: PretrainedConfig, layer_idx: int) -> nn.Module:
        activation = canonical_activation(getattr(hf_config, "hidden_act", "silu"))
        return GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, activation)

    def make_layer(self, hf_config: PretrainedConfig, layer_idx: int, attn_backend: AttentionBackend) -> DecoderLayer:
        c = hf_config
        if c.layer_types[layer_idx] == LINEAR_ATTENTION:
            mixer: nn.Module = GatedDeltaNet(
                c.hidden_size,
                c.linear_num_key_heads,
                c.linear_num_value_heads,
                c.linear_key_head_dim,
                c.linear_value_head_dim,
                c.linear_conv_kernel_dim,
                c.rms_norm_eps,
                interleaved_projection=self.interleaved_projection,
            )
            name = "linear_attn"
        else:
            bias = bool(getattr(c, "attention_bias", False))
            spec = attention_spec(c, layer_idx, bias, bias, qk_norm=True, qk_norm_eps=c.rms_norm_eps, qk_norm_offset=1.0, output_gate=True)
            mixer, name = Attention(spec, layer_idx, attn_backend, tp_shard_of(c)), "self_attn"
        mlp = self.make_mlp(c, layer_idx)
        return DecoderLayer(mixer, mlp, c.hidden_size, c.rms_norm_eps, mixer_name=name, norm_offset=1.0)

    def build_model(self, hf_config: PretrainedConfig, attn_backend: AttentionBackend) -> DecoderModel:
        layers = [self.make_layer(hf_config, i, attn_backend) for i in range(hf_config.num_hidden_layers)]
        return DecoderModel(hf_config, layers, final_norm_offset=1.0)


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM):
    """Every layer's MLP is routed experts with a shared expert."""

    def make_mlp(self, hf_config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return SharedExpertMoE(hf_config)


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3.5's layers with interleaved linear-attention projections; MoE on the layers that
    ``decoder_sparse_step`` and ``mlp_only_layers`` pick, a dense MLP elsewhere."""

    interleaved_projection = True

    def make_mlp(self, hf_config: PretrainedConfig, layer_idx: int) -> nn.Module:
        step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
        only_mlp = getattr(hf_config, "mlp_only_layers", None) or []
        if layer_idx not in only_mlp and hf_config.num_experts > 0 and (layer_idx + 1) % step == 0:
            return SharedExpertMoE(hf_config)
        return super().make_mlp(hf_config, layer_idx)
