"""NVIDIA Nemotron-H and Nemotron 3 Nano (``NemotronHForCausalLM``, transformers' ``nemotron_h``).

Each layer is one block, ``x + mixer(rmsnorm(x))``, of the kind ``layers_block_type`` gives it (a
checkpoint's ``hybrid_override_pattern``): Mamba-2 (``M``, ``linear_attention``), attention without
positional encoding (``*``), a squared-ReLU MLP without a gate (``-``), or a mixture of squared-ReLU
experts (``E``: sigmoid scores with a correction bias that picks the top k, the weights renormalised
and scaled by ``routed_scaling_factor``, beside one shared expert). The Mamba blocks keep a state slot
per request, the attention blocks KV, the MLP and MoE blocks nothing (:meth:`no_cache_layers`).

Checkpoints name the trunk ``backbone.`` (``embeddings``, ``layers.N.norm`` and ``.mixer``,
``norm_f``); GGUF files (llama.cpp's ``nemotron_h`` and ``nemotron_h_moe``) are mapped to the same
names by pagellm.models.gguf_arch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from pagellm.attention.backend import AttentionBackend
from pagellm.layers.attention import Attention, AttentionSpec
from pagellm.layers.mamba2 import Mamba2Mixer, mamba2_state_shapes
from pagellm.layers.mlp import MLP
from pagellm.layers.moe import FusedMoE
from pagellm.layers.norm import RMSNorm
from pagellm.layers.rotary import RotaryArgs
from pagellm.models.decoder import LLAMA_STACKED_PARAMS, CausalLM, DecoderModel, tp_shard_of
from pagellm.models.shape import StateTensorShape

if TYPE_CHECKING:
    from transformers import PretrainedConfig

MAMBA, ATTENTION, MLP_BLOCK, MOE = "linear_attention", "full_attention", "mlp", "moe"
# Checkpoint names -> ours: the trunk (``backbone.``, or ``model.`` in some exports) and the routing
# bias, which the router's checkpoint module holds and our MoE layer owns.
_RENAMES = (
    ("backbone.embeddings.", "model.embed_tokens."),
    ("model.embeddings.", "model.embed_tokens."),
    ("backbone.norm_f.", "model.norm."),
    ("model.norm_f.", "model.norm."),
    ("backbone.", "model."),
    (".mixer.gate.e_score_correction_bias", ".mixer.e_score_correction_bias"),
)


def layers_of(hf_config: PretrainedConfig, *kinds: str) -> tuple[int, ...]:
    block_types = list(hf_config.layers_block_type)
    unknown = sorted(set(block_types) - {MAMBA, ATTENTION, MLP_BLOCK, MOE})
    if unknown:
        raise ValueError(f"unsupported Nemotron-H block types {unknown}; supported: {MAMBA}, {ATTENTION}, {MLP_BLOCK}, {MOE}")
    return tuple(i for i, kind in enumerate(block_types) if kind in kinds)


class NemotronHMoE(FusedMoE):
    """Routed squared-ReLU experts plus a shared one, their outputs summed."""

    def __init__(self, c: PretrainedConfig) -> None:
        if getattr(c, "moe_latent_size", None) is not None:
            raise ValueError("Nemotron-H experts in a latent space (moe_latent_size) are not supported")
        super().__init__(
            c.hidden_size,
            c.n_routed_experts,
            c.num_experts_per_tok,
            c.moe_intermediate_size,
            c.mlp_hidden_act,
            renormalize=bool(c.norm_topk_prob),
            scoring="sigmoid",
            e_score_correction_bias=True,
            routed_scaling_factor=float(c.routed_scaling_factor),
            num_expert_groups=int(c.n_group),
            num_groups_used=int(c.topk_group),
            gated=False,
        )
        self.shared_experts = MLP(c.hidden_size, c.moe_shared_expert_intermediate_size, c.mlp_hidden_act, bias=bool(c.mlp_bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shared_experts(x)


class NemotronHBlock(nn.Module):
    """``x + mixer(norm(x))``, with the residual add pending as :class:`~pagellm.models.decoder.DecoderLayer`'s;
    ``cached``: the mixer reads a cache (KV or a state slot) and the step's metadata."""

    def __init__(self, mixer: nn.Module, hidden_size: int, eps: float, cached: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.mixer = mixer
        self.cached = cached
        self.layer_type = None  # DecoderModel's rotary kind: none, the attention has no positions (NoPE)

    def forward(
        self, hidden: torch.Tensor, residual: Optional[torch.Tensor], rope: Optional[RotaryArgs], cache: object, metadata: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = self.norm.add_and_norm(hidden, residual)
        return (self.mixer(hidden, rope, cache, metadata) if self.cached else self.mixer(hidden)), residual


class NemotronHForCausalLM(CausalLM):
    stacked_params = LLAMA_STACKED_PARAMS[:3]  # q/k/v only: the MLPs' up_proj has no gate to join

    @classmethod
    def recurrent_state(cls, hf_config: PretrainedConfig) -> tuple[tuple[int, ...], tuple[StateTensorShape, ...]]:
        c = hf_config
        return layers_of(c, MAMBA), mamba2_state_shapes(c.mamba_num_heads, c.mamba_head_dim, c.n_groups, c.ssm_state_size, c.conv_kernel)

    @classmethod
    def no_cache_layers(cls, hf_config: PretrainedConfig) -> tuple[int, ...]:
        return layers_of(hf_config, MLP_BLOCK, MOE)

    def checkpoint_target(self, name: str) -> tuple[str, Optional[str]]:
        for old, new in _RENAMES:
            if old in name and (old.startswith(".") or name.startswith(old)):
                name = name.replace(old, new, 1)
        return super().checkpoint_target(name)

    def make_mixer(self, c: PretrainedConfig, layer_idx: int, attn_backend: AttentionBackend) -> tuple[nn.Module, bool]:
        """Layer ``layer_idx``'s mixer, and whether it reads a cache."""
        kind = c.layers_block_type[layer_idx]
        if kind == MAMBA:
            if c.mamba_hidden_act != "silu":
                raise ValueError(f"Nemotron-H Mamba activation {c.mamba_hidden_act!r} is not supported (silu)")
            mixer = Mamba2Mixer(
                c.hidden_size, c.mamba_num_heads, c.mamba_head_dim, c.n_groups, c.ssm_state_size, c.conv_kernel, c.layer_norm_epsilon,
                conv_bias=bool(c.use_conv_bias), proj_bias=bool(c.use_bias),
                # transformers' chunked scan clamps the time steps from below at time_step_min (its decode does not).
                time_step_limit=(float(c.time_step_min), float("inf")),
            )
            return mixer, True
        if kind == ATTENTION:
            head_dim = c.head_dim
            spec = AttentionSpec(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, head_dim, head_dim**-0.5)
            return Attention(spec, layer_idx, attn_backend, tp_shard_of(c)), True
        if kind == MLP_BLOCK:
            return MLP(c.hidden_size, c.intermediate_size, c.mlp_hidden_act, bias=bool(c.mlp_bias)), False
        return NemotronHMoE(c), False

    def build_model(self, hf_config: PretrainedConfig, attn_backend: AttentionBackend) -> DecoderModel:
        layers_of(hf_config)  # unknown block types fail here, by name
        blocks = []
        for i in range(hf_config.num_hidden_layers):
            mixer, cached = self.make_mixer(hf_config, i, attn_backend)
            blocks.append(NemotronHBlock(mixer, hf_config.hidden_size, hf_config.layer_norm_epsilon, cached))
        return DecoderModel(hf_config, blocks, rotary_layer_types=(), norm_eps=hf_config.layer_norm_epsilon)
