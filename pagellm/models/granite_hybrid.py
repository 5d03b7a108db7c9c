"""IBM Granite 4.0-H (``GraniteMoeHybridForCausalLM``): Mamba-2 layers (``mamba``, most of them) and
full attention (``attention``), each followed by a shared MLP and, in the MoE models, routed experts
beside it (softmax over the top-k router logits). Granite's multipliers: the embeddings are scaled by
``embedding_multiplier``, each sublayer's output by ``residual_multiplier`` before the residual add,
attention scores by ``attention_multiplier`` (the scale itself, not 1/sqrt(d)), and the logits are
divided by ``logits_scaling``. Attention rotates positions only with ``position_embedding_type: rope``
(Granite 4.0-H is NoPE: the Mamba layers carry position).

The checkpoint stores each layer's experts as one tensor per projection (``input_linear``: every
expert's gate rows then up rows; ``output_linear``), and the shared MLP's gate and up as one
``input_linear``. The Mamba layers keep a state slot per request (pagellm.core.state_cache).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Optional

import torch

from pagellm.attention.backend import AttentionBackend, AttentionMetadata
from pagellm.layers.activation import canonical_activation
from pagellm.layers.attention import Attention
from pagellm.layers.linear_method import WeightSource
from pagellm.layers.mamba2 import Mamba2Mixer, mamba2_state_shapes
from pagellm.layers.mlp import GatedMLP
from pagellm.layers.moe import FusedMoE
from pagellm.layers.rotary import RotaryArgs
from pagellm.models.decoder import LLAMA_STACKED_PARAMS, CausalLM, DecoderLayer, DecoderModel, tp_shard_of
from pagellm.models.llama import attention_spec
from pagellm.models.shape import StateTensorShape

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# transformers 5 names the layer kinds linear_attention / full_attention; config files say mamba / attention.
MAMBA_LAYER_TYPES = ("mamba", "linear_attention")


class GraniteHybridLayer(DecoderLayer):
    """A pre-norm block whose sublayer outputs are scaled by ``residual_multiplier``, with the shared
    MLP and, where the model has experts, the routed experts summed."""

    def __init__(self, mixer: torch.nn.Module, mixer_name: str, shared_mlp: GatedMLP, moe: Optional[FusedMoE], hf_config) -> None:
        super().__init__(mixer, shared_mlp, hf_config.hidden_size, hf_config.rms_norm_eps, mlp_name="shared_mlp", mixer_name=mixer_name)
        self.block_sparse_moe = moe
        self.residual_multiplier = float(hf_config.residual_multiplier)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: Optional[torch.Tensor],
        rope: Optional[RotaryArgs],
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self._modules[self.mixer_name](hidden, rope, kv_cache, attn_metadata) * self.residual_multiplier
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        out = self.shared_mlp(hidden)
        if self.block_sparse_moe is not None:
            out = self.block_sparse_moe(hidden) + out
        return out * self.residual_multiplier, residual


class GraniteMoeHybridForCausalLM(CausalLM):
    stacked_params = LLAMA_STACKED_PARAMS + (("gate_up_proj", "input_linear", None), ("down_proj", "output_linear", None))

    @classmethod
    def recurrent_state(cls, hf_config: PretrainedConfig) -> tuple[tuple[int, ...], tuple[StateTensorShape, ...]]:
        c = hf_config
        layer_ids = tuple(i for i, kind in enumerate(c.layer_types) if kind in MAMBA_LAYER_TYPES)
        return layer_ids, mamba2_state_shapes(c.mamba_n_heads, c.mamba_d_head, c.mamba_n_groups, c.mamba_d_state, c.mamba_d_conv)

    def make_layer(self, hf_config: PretrainedConfig, layer_idx: int, attn_backend: AttentionBackend) -> GraniteHybridLayer:
        c = hf_config
        if c.layer_types[layer_idx] in MAMBA_LAYER_TYPES:
            limit = tuple(c.time_step_limit or (0.0, float("inf")))
            mixer: torch.nn.Module = Mamba2Mixer(
                c.hidden_size, c.mamba_n_heads, c.mamba_d_head, c.mamba_n_groups, c.mamba_d_state, c.mamba_d_conv, c.rms_norm_eps,
                conv_bias=bool(c.mamba_conv_bias), proj_bias=bool(c.mamba_proj_bias), time_step_limit=limit, chunk_size=c.mamba_chunk_size,
            )
            name = "mamba"
        else:
            bias = bool(getattr(c, "attention_bias", False))
            spec = dataclasses.replace(attention_spec(c, layer_idx, bias, bias), scale=float(c.attention_multiplier))
            mixer, name = Attention(spec, layer_idx, attn_backend, tp_shard_of(c)), "self_attn"
        activation = canonical_activation(getattr(c, "hidden_act", "silu"))
        shared = GatedMLP(c.hidden_size, c.shared_intermediate_size, activation)
        moe = None
        if c.num_local_experts:
            moe = FusedMoE(
                c.hidden_size, c.num_local_experts, c.num_experts_per_tok, c.intermediate_size, activation,
                softmax_after_topk=True, router_name="router",
            )
        return GraniteHybridLayer(mixer, name, shared, moe, c)

    def build_model(self, hf_config: PretrainedConfig, attn_backend: AttentionBackend) -> DecoderModel:
        layers = [self.make_layer(hf_config, i, attn_backend) for i in range(hf_config.num_hidden_layers)]
        rotary = (None,) if getattr(hf_config, "position_embedding_type", None) == "rope" else ()
        return DecoderModel(hf_config, layers, embed_scale=float(hf_config.embedding_multiplier), rotary_layer_types=rotary)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / float(self.config.logits_scaling)

    def load_weights(self, weights: Iterable[tuple[str, WeightSource]], *args, **kwargs) -> set[str]:
        return super().load_weights(_per_expert(weights), *args, **kwargs)


def _per_expert(weights: Iterable[tuple[str, WeightSource]]) -> Iterator[tuple[str, WeightSource]]:
    """The routed experts' stacked tensors as each expert's projections (views), the router's
    ``router.layer`` as ``router``; everything else as it comes."""
    for name, tensor in weights:
        prefix, moe, rest = name.partition(".block_sparse_moe.")
        if not moe:
            yield name, tensor
        elif rest == "router.layer.weight":
            yield f"{prefix}.block_sparse_moe.router.weight", tensor
        elif rest == "input_linear.weight":  # [experts, 2 * inter, hidden]: gate rows, then up rows
            inter = tensor.shape[1] // 2
            for e, part in enumerate(tensor):
                yield f"{prefix}.block_sparse_moe.experts.{e}.gate_proj.weight", part[:inter]
                yield f"{prefix}.block_sparse_moe.experts.{e}.up_proj.weight", part[inter:]
        elif rest == "output_linear.weight":  # [experts, hidden, inter]
            for e, part in enumerate(tensor):
                yield f"{prefix}.block_sparse_moe.experts.{e}.down_proj.weight", part
        else:
            yield name, tensor
