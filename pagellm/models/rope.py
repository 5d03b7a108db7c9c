"""Rotary position embeddings with a precomputed cos/sin table indexed by token position.

The inverse frequencies come from transformers' own RoPE initializers, so every scaling variant
we accept produces exactly the frequencies transformers would use for the same config.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# Variants whose frequencies do not depend on the current sequence length, so one table serves
# every position. "dynamic" and "longrope" switch frequencies with the length of the whole batch in
# transformers, which cannot agree with keys already written to a KV cache.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def get_rope_parameters(hf_config: PretrainedConfig) -> dict[str, Any]:
    """The config's RoPE settings as one dict with at least ``rope_type`` and ``rope_theta``.

    transformers 5 keeps them in ``rope_parameters``; older configs split them between
    ``rope_theta`` and ``rope_scaling``.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    # Old configs spell the variant "type", and "mrope"-free Llama configs may omit it entirely.
    rope_type = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = rope_type
    return params


def head_dim_of(hf_config: PretrainedConfig) -> int:
    """The per-head width: ``head_dim`` when the config states it, otherwise hidden / heads."""
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim) if head_dim else hf_config.hidden_size // hf_config.num_attention_heads


def max_rope_positions(hf_config: PretrainedConfig) -> int:
    """How many positions the model is meant to see, after any RoPE context extension.

    Follows vLLM: linear and YaRN scaling stretch the trained context by ``factor`` (YaRN from
    ``original_max_position_embeddings`` when given); llama3 configs already state the extended
    length in ``max_position_embeddings``.
    """
    max_positions = int(hf_config.max_position_embeddings)
    params = get_rope_parameters(hf_config)
    factor = params.get("factor")
    if params["rope_type"] == "linear" and factor:
        max_positions = int(max_positions * factor)
    elif params["rope_type"] == "yarn" and factor:
        original = params.get("original_max_position_embeddings", max_positions)
        max_positions = max(max_positions, int(original * factor))
    return max_positions


def _inverse_frequencies(hf_config: PretrainedConfig, device: torch.device) -> tuple[torch.Tensor, float]:
    rope_type = get_rope_parameters(hf_config)["rope_type"]
    if rope_type == "default":
        # transformers' Llama computes the default frequencies itself, not through the table.
        base = get_rope_parameters(hf_config)["rope_theta"]
        dim = head_dim_of(hf_config)
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
        return inv_freq, 1.0
    return ROPE_INIT_FUNCTIONS[rope_type](hf_config, device=device)


def check_rope_config(hf_config: PretrainedConfig) -> None:
    """Raise ValueError for RoPE settings this engine cannot serve."""
    rope_type = get_rope_parameters(hf_config)["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"RoPE scaling type {rope_type!r} is not supported; supported types: {', '.join(SUPPORTED_ROPE_TYPES)}."
        )
    partial = get_rope_parameters(hf_config).get("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor={partial}) are not supported.")


@dataclass
class RotaryArgs:
    """One forward pass's rotation inputs, prepared once and shared by every layer."""

    positions: torch.Tensor  # int64 [T]
    # fused: the whole tables [max_positions, head_dim // 2], gathered inside the kernel;
    # otherwise this step's rows [T, 1, head_dim // 2], ready to broadcast over heads.
    cos: torch.Tensor
    sin: torch.Tensor
    fused: bool


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves), as Llama, Mistral and Qwen2 use.

    The cos/sin table is built on first use on the device of ``positions``, so the module can be
    created on the meta device and moved anywhere without carrying a stale table along.
    """

    def __init__(self, hf_config: PretrainedConfig) -> None:
        super().__init__()
        check_rope_config(hf_config)
        self.hf_config = hf_config
        self.head_dim = head_dim_of(hf_config)
        self.max_positions = max_rope_positions(hf_config)
        self._cos: torch.Tensor | None = None  # [max_positions, head_dim // 2], float32
        self._sin: torch.Tensor | None = None

    def _build(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, attention_scaling = _inverse_frequencies(self.hf_config, device)
        if inv_freq.numel() * 2 != self.head_dim:
            raise ValueError(f"RoPE has {inv_freq.numel() * 2} rotary dims but head_dim is {self.head_dim}.")
        t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq.to(torch.float32))
        self._cos = freqs.cos() * attention_scaling
        self._sin = freqs.sin() * attention_scaling
        return self._cos, self._sin

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin tables, ``[max_positions, head_dim // 2]`` float32, on ``device``."""
        if self._cos is None or self._sin is None or self._cos.device != device:
            return self._build(device)
        return self._cos, self._sin

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype, fused: bool) -> RotaryArgs:
        """The rotation inputs for this step: whole tables for the fused kernel, else gathered rows."""
        if fused:
            return RotaryArgs(positions, *self.tables(positions.device), fused=True)
        return RotaryArgs(positions, *self.cos_sin(positions, dtype), fused=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, ``[T, 1, head_dim // 2]`` each, ready to broadcast over heads."""
        cos_table, sin_table = self.tables(positions.device)
        cos = cos_table.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = sin_table.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]``; returns a new contiguous tensor.

    Same arithmetic as transformers' ``x * cos + rotate_half(x) * sin``, without building the
    doubled cos/sin tables.
    """
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
