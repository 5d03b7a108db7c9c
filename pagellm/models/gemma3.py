"""Gemma 3 (text): Llama-like attention with q/k norms, five sliding-window layers to one global
(``layer_types``), a rotary base per layer kind, embeddings scaled by sqrt(hidden), a norm before
and after both the attention and the MLP, Gemma's ``(1 + w)`` RMSNorm and a GELU-tanh MLP."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from pagellm.attention.backend import AttentionBackend, AttentionMetadata
from pagellm.layers.activation import canonical_activation
from pagellm.layers.attention import Attention, AttentionSpec
from pagellm.layers.mlp import GatedMLP
from pagellm.layers.norm import RMSNorm
from pagellm.layers.rotary import RotaryArgs, head_dim_of
from pagellm.models.decoder import CausalLM, DecoderModel, tp_shard_of
from pagellm.models.shape import FULL, SLIDING, layer_sliding_windows

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Gemma's norms multiply by (1 + w); the offset is added to the weights once, at load.
GEMMA_NORM_OFFSET = 1.0


class Gemma3DecoderLayer(torch.nn.Module):
    def __init__(self, hf_config: PretrainedConfig, layer_idx: int, attn_backend: AttentionBackend) -> None:
        super().__init__()
        window = layer_sliding_windows(hf_config)[layer_idx]
        self.layer_type = SLIDING if window is not None else FULL
        head_dim, eps = head_dim_of(hf_config), hf_config.rms_norm_eps
        bias = bool(getattr(hf_config, "attention_bias", False))
        spec = AttentionSpec(
            hidden_size=hf_config.hidden_size,
            num_heads=hf_config.num_attention_heads,
            num_kv_heads=hf_config.num_key_value_heads,
            head_dim=head_dim,
            scale=float(hf_config.query_pre_attn_scalar) ** -0.5,
            qkv_bias=bias,
            o_bias=bias,
            qk_norm=True,
            qk_norm_eps=eps,
            qk_norm_offset=GEMMA_NORM_OFFSET,
            sliding_window=window,
            logits_soft_cap=getattr(hf_config, "attn_logit_softcapping", None),
        )
        self.self_attn = Attention(spec, layer_idx, attn_backend, tp_shard_of(hf_config))
        act = getattr(hf_config, "hidden_activation", None) or getattr(hf_config, "hidden_act", "gelu_pytorch_tanh")
        self.mlp = GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, canonical_activation(act))
        hidden = hf_config.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps, GEMMA_NORM_OFFSET)
        self.post_attention_layernorm = RMSNorm(hidden, eps, GEMMA_NORM_OFFSET)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, GEMMA_NORM_OFFSET)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, GEMMA_NORM_OFFSET)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: Optional[torch.Tensor],
        rope: RotaryArgs,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(hidden, rope, kv_cache, attn_metadata))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class Gemma3ForCausalLM(CausalLM):
    def __init__(self, hf_config: PretrainedConfig, attn_backend: AttentionBackend) -> None:
        super().__init__(hf_config, attn_backend)
        self.final_logit_softcapping = getattr(hf_config, "final_logit_softcapping", None)

    def build_model(self, hf_config: PretrainedConfig, attn_backend: AttentionBackend) -> DecoderModel:
        layers = [Gemma3DecoderLayer(hf_config, i, attn_backend) for i in range(hf_config.num_hidden_layers)]
        return DecoderModel(
            hf_config,
            layers,
            embed_scale=hf_config.hidden_size**0.5,
            rotary_layer_types=(SLIDING, FULL),
            final_norm_offset=GEMMA_NORM_OFFSET,
        )
