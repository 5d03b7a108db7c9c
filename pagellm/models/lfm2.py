"""LFM2 and LFM2-MoE (Liquid AI): hybrids of gated short convolutions (the ``conv`` layers, most of
them; pagellm.layers.short_conv) and grouped-query attention with a per-head RMSNorm on q and k
(``full_attention`` layers, from ``layer_types`` or ``full_attn_idxs``). Every block is pre-norm
(``operator_norm`` before the mixer, ``ffn_norm`` before the feed-forward) with a SwiGLU MLP (w1
gate, w3 up, w2 down) after each mixer; the final norm is ``embedding_norm``. LFM2's MLP width is
``intermediate_size`` cut to 2/3, scaled and rounded up when ``block_auto_adjust_ff_dim`` is set.

LFM2-MoE's blocks after the first ``num_dense_layers`` route over experts by the sigmoid of their
logits, a per-expert bias (``expert_bias``) choosing the top k only, the chosen scores renormalised.
The conv layers keep a state slot per request (pagellm.core.state_cache).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from torch import nn

from pagellm.attention.backend import AttentionBackend
from pagellm.layers.attention import Attention
from pagellm.layers.mlp import GatedMLP
from pagellm.layers.moe import FusedMoE
from pagellm.layers.short_conv import ShortConv
from pagellm.models.decoder import LLAMA_STACKED_PARAMS, CausalLM, DecoderLayer, DecoderModel, tp_shard_of
from pagellm.models.llama import attention_spec
from pagellm.models.shape import StateTensorShape

if TYPE_CHECKING:
    from transformers import PretrainedConfig

CONV = "conv"


def layer_types(hf_config: PretrainedConfig) -> list[str]:
    """Each layer's kind, ``conv`` or ``full_attention``, as the config lists them."""
    types = getattr(hf_config, "layer_types", None)
    if types is None:
        full = getattr(hf_config, "full_attn_idxs", None)
        if full is None:
            raise ValueError("an LFM2 config needs layer_types or full_attn_idxs to say which layers attend")
        types = ["full_attention" if i in full else CONV for i in range(hf_config.num_hidden_layers)]
    if len(types) != hf_config.num_hidden_layers or set(types) - {CONV, "full_attention"}:
        raise ValueError(f"LFM2 layer_types {list(types)} for {hf_config.num_hidden_layers} layers: each conv or full_attention")
    return list(types)


def dense_intermediate_size(hf_config: PretrainedConfig) -> int:
    """The dense MLP's width as transformers' Lfm2MLP computes it from the config."""
    size = int(hf_config.intermediate_size)
    if getattr(hf_config, "block_auto_adjust_ff_dim", False):
        size = int(2 * size / 3)
        multiplier = getattr(hf_config, "block_ffn_dim_multiplier", None)
        if multiplier is not None:
            multiple = int(hf_config.block_multiple_of)
            size = multiple * ((int(multiplier * size) + multiple - 1) // multiple)
    return size


class Lfm2ForCausalLM(CausalLM):
    stacked_params = LLAMA_STACKED_PARAMS + (
        ("gate_up_proj", "w1", "gate"),
        ("gate_up_proj", "w3", "up"),
        ("down_proj", "w2", None),
        ("self_attn.o_proj", "self_attn.out_proj", None),
        ("q_norm", "q_layernorm", None),
        ("k_norm", "k_layernorm", None),
        ("input_layernorm", "operator_norm", None),
        ("post_attention_layernorm", "ffn_norm", None),
        ("norm", "embedding_norm", None),
    )

    @classmethod
    def recurrent_state(cls, hf_config: PretrainedConfig) -> tuple[tuple[int, ...], tuple[StateTensorShape, ...]]:
        """The conv layers and their state: the convolution's last ``conv_L_cache - 1`` inputs, split by channel."""
        layer_ids = tuple(i for i, kind in enumerate(layer_types(hf_config)) if kind == CONV)
        return layer_ids, (StateTensorShape((hf_config.conv_L_cache - 1, hf_config.hidden_size), 1, ssm=False),)

    def make_mlp(self, hf_config: PretrainedConfig, layer_idx: int) -> nn.Module:
        return GatedMLP(hf_config.hidden_size, dense_intermediate_size(hf_config), "silu")

    def make_layer(self, hf_config: PretrainedConfig, layer_idx: int, kind: str, attn_backend: AttentionBackend) -> DecoderLayer:
        c = hf_config
        mixer: nn.Module
        if kind == CONV:
            mixer, name = ShortConv(c.hidden_size, c.conv_L_cache, bool(c.conv_bias)), "conv"
        else:
            spec = attention_spec(c, layer_idx, False, False, qk_norm=True, qk_norm_eps=c.norm_eps)
            mixer, name = Attention(spec, layer_idx, attn_backend, tp_shard_of(c)), "self_attn"
        mlp = self.make_mlp(c, layer_idx)
        return DecoderLayer(mixer, mlp, c.hidden_size, c.norm_eps, mixer_name=name, mlp_name="feed_forward")

    def build_model(self, hf_config: PretrainedConfig, attn_backend: AttentionBackend) -> DecoderModel:
        layers = [self.make_layer(hf_config, i, kind, attn_backend) for i, kind in enumerate(layer_types(hf_config))]
        return DecoderModel(hf_config, layers, norm_eps=hf_config.norm_eps)


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    """LFM2's layers; after the first ``num_dense_layers`` blocks a mixture of experts replaces the MLP."""

    def make_mlp(self, hf_config: PretrainedConfig, layer_idx: int) -> nn.Module:
        c = hf_config
        if layer_idx < c.num_dense_layers:
            return GatedMLP(c.hidden_size, c.intermediate_size, "silu")
        return FusedMoE(
            c.hidden_size,
            c.num_experts,
            c.num_experts_per_tok,
            c.moe_intermediate_size,
            "silu",
            renormalize=bool(c.norm_topk_prob),
            scoring="sigmoid",
            e_score_correction_bias=bool(c.use_expert_bias),
            routed_scaling_factor=float(c.routed_scaling_factor),
        )

    def checkpoint_target(self, name: str) -> tuple[str, Optional[str]]:
        if name.endswith(".feed_forward.expert_bias"):  # a buffer of the block in transformers, FusedMoE's own tensor here
            return name.removesuffix("expert_bias") + "e_score_correction_bias", None
        return super().checkpoint_target(name)
