"""Llama and the models that are Llama with other bias flags (Mistral, Qwen2), on the layer library.

Q/K/V and gate/up are each one fused projection, stacked from the Hugging Face weights at load
time, so a layer does four matmuls instead of seven.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from pagellm.attention.backend import AttentionBackend
from pagellm.layers.activation import canonical_activation
from pagellm.layers.attention import Attention, AttentionSpec
from pagellm.layers.mlp import GatedMLP
from pagellm.layers.rotary import head_dim_of
from pagellm.models.decoder import CausalLM, DecoderLayer, DecoderModel, tp_shard_of
from pagellm.models.shape import layer_sliding_windows

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def attention_spec(hf_config: PretrainedConfig, layer_idx: int, qkv_bias: bool, o_bias: bool, **extra) -> AttentionSpec:
    """The attention of layer ``layer_idx`` as a Llama-style config states it."""
    num_heads = hf_config.num_attention_heads
    head_dim = head_dim_of(hf_config)
    return AttentionSpec(
        hidden_size=hf_config.hidden_size,
        num_heads=num_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        scale=head_dim**-0.5,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        sliding_window=layer_sliding_windows(hf_config)[layer_idx],
        **extra,
    )


class LlamaForCausalLM(CausalLM):
    """Llama 2/3.x: biases as the config states them (``attention_bias``, ``mlp_bias``)."""

    @staticmethod
    def bias_flags(hf_config: PretrainedConfig) -> tuple[bool, bool, bool]:
        """Whether (q/k/v, o, MLP) projections carry biases."""
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        return attention_bias, attention_bias, bool(getattr(hf_config, "mlp_bias", False))

    # The attribute the checkpoint names a layer's MLP by (Mixtral: block_sparse_moe).
    mlp_name = "mlp"

    def attention_extra(self, hf_config: PretrainedConfig) -> dict:
        """AttentionSpec fields beyond Llama's (a subclass's q/k norm, soft cap, ...)."""
        return {}

    def make_mlp(self, hf_config: PretrainedConfig, layer_idx: int) -> nn.Module:
        activation = canonical_activation(getattr(hf_config, "hidden_act", "silu"))
        return GatedMLP(hf_config.hidden_size, hf_config.intermediate_size, activation, bias=self.bias_flags(hf_config)[2])

    def make_layer(self, hf_config: PretrainedConfig, layer_idx: int, attn_backend: AttentionBackend) -> DecoderLayer:
        qkv_bias, o_bias, _ = self.bias_flags(hf_config)
        spec = attention_spec(hf_config, layer_idx, qkv_bias, o_bias, **self.attention_extra(hf_config))
        attn = Attention(spec, layer_idx, attn_backend, tp_shard_of(hf_config))
        mlp = self.make_mlp(hf_config, layer_idx)
        return DecoderLayer(attn, mlp, hf_config.hidden_size, hf_config.rms_norm_eps, mlp_name=self.mlp_name)

    def build_model(self, hf_config: PretrainedConfig, attn_backend: AttentionBackend) -> DecoderModel:
        layers = [self.make_layer(hf_config, i, attn_backend) for i in range(hf_config.num_hidden_layers)]
        return DecoderModel(hf_config, layers)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama without biases (and, in v0.1, a 4,096-token window on every layer)."""

    @staticmethod
    def bias_flags(hf_config: PretrainedConfig) -> tuple[bool, bool, bool]:
        return False, False, False


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 is Llama with biases on the q/k/v projections only."""

    @staticmethod
    def bias_flags(hf_config: PretrainedConfig) -> tuple[bool, bool, bool]:
        return True, False, False
