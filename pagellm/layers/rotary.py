"""Rotary position embeddings with a precomputed cos/sin table indexed by token position.

The inverse frequencies come from transformers' own RoPE initializers, so every scaling variant
we accept produces exactly the frequencies transformers would use for the same config; a model
whose layer kinds rotate differently (Gemma 3: one base for sliding layers, another for full ones)
builds one table per ``layer_type``. Partial rotary (Phi-4-mini) rotates the first
``rotary_dim`` of each head and leaves the rest. Proportional RoPE (Gemma 4's full layers) pairs
dimensions across the whole head as plain RoPE does, with the frequencies past its rotary share
zero, so it is a whole-head table whose last pairs do not turn.

LongRoPE's short and long factors: transformers switches the whole forward pass to the long ones
once the sequence passes ``original_max_position_embeddings``, which cannot agree with keys
already in a paged cache; here positions below that limit use the short factors and positions
from it on the long ones (so a sequence within the original context matches transformers exactly).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagellm.kernels import ops

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# Variants whose frequencies do not depend on the current sequence length, so one table serves
# every position. "dynamic" and "longrope" switch frequencies with the length of the whole batch in
# transformers, which cannot agree with keys already written to a KV cache.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope", "proportional")


def get_rope_parameters(hf_config: PretrainedConfig, layer_type: str | None = None) -> dict[str, Any]:
    """The config's RoPE settings as one dict with at least ``rope_type`` and ``rope_theta``.

    transformers 5 keeps them in ``rope_parameters`` (keyed by layer type where the kinds differ);
    older configs split them between ``rope_theta`` and ``rope_scaling``.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        params = params[layer_type] if layer_type in params else next(iter(params.values()))
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    # Old configs spell the variant "type", and "mrope"-free Llama configs may omit it entirely.
    rope_type = params.get("rope_type", params.get("type", "default"))
    params["rope_type"] = rope_type
    return params


def rotary_dim_of(hf_config: PretrainedConfig, layer_type: str | None = None) -> int:
    """How many of each head's dimensions rotate (``partial_rotary_factor`` of them; all of them
    for proportional RoPE, whose table has zero frequencies past that share)."""
    params = get_rope_parameters(hf_config, layer_type)
    if params["rope_type"] == "proportional":
        return head_dim_of(hf_config)
    factor = params.get("partial_rotary_factor")
    if factor is None:
        factor = getattr(hf_config, "partial_rotary_factor", None) or 1.0
    return int(head_dim_of(hf_config) * float(factor))


def head_dim_of(hf_config: PretrainedConfig) -> int:
    """The per-head width: ``head_dim`` when the config states it, otherwise hidden / heads."""
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim) if head_dim else hf_config.hidden_size // hf_config.num_attention_heads


def max_rope_positions(hf_config: PretrainedConfig) -> int:
    """How many positions the model is meant to see, after any RoPE context extension.

    Follows vLLM: linear and YaRN scaling stretch the trained context by ``factor`` (YaRN from
    ``original_max_position_embeddings`` when given); llama3 configs already state the extended
    length in ``max_position_embeddings``, as do configs whose layer kinds rotate differently
    (Gemma 3's linear factor applies to its global layers only).
    """
    max_positions = int(hf_config.max_position_embeddings)
    by_layer = getattr(hf_config, "rope_parameters", None)
    if isinstance(by_layer, dict) and by_layer and all(isinstance(v, dict) for v in by_layer.values()):
        return max_positions
    params = get_rope_parameters(hf_config)
    factor = params.get("factor")
    if params["rope_type"] == "linear" and factor:
        max_positions = int(max_positions * factor)
    elif params["rope_type"] == "yarn" and factor:
        original = params.get("original_max_position_embeddings", max_positions)
        max_positions = max(max_positions, int(original * factor))
    return max_positions


def _inverse_frequencies(
    hf_config: PretrainedConfig, device: torch.device, layer_type: str | None, seq_len: int | None = None
) -> tuple[torch.Tensor, float]:
    params = get_rope_parameters(hf_config, layer_type)
    if params["rope_type"] == "default":
        # transformers' models compute the default frequencies themselves, not through the table.
        dim = rotary_dim_of(hf_config, layer_type)
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
        return inv_freq, 1.0
    # The scaled variants' table imports most of transformers (slow at a server's start-up):
    # only configs that scale need it.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kwargs: dict[str, Any] = {"device": device, "seq_len": seq_len}
    if layer_type is not None:
        kwargs["layer_type"] = layer_type
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](hf_config, **kwargs)


def check_rope_config(hf_config: PretrainedConfig, layer_type: str | None = None) -> None:
    """Raise ValueError for RoPE settings this engine cannot serve."""
    rope_type = get_rope_parameters(hf_config, layer_type)["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"RoPE scaling type {rope_type!r} is not supported; supported types: {', '.join(SUPPORTED_ROPE_TYPES)}."
        )
    if rotary_dim_of(hf_config, layer_type) % 2:
        raise ValueError(f"the rotary part of each head ({rotary_dim_of(hf_config, layer_type)}) must be even.")


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
    """Neox-style rotary embedding (rotate halves), as Llama, Mistral, Qwen, Gemma and Phi use.

    The cos/sin table is built on first use on the device of ``positions``, so the module can be
    created on the meta device and moved anywhere without carrying a stale table along.
    """

    def __init__(self, hf_config: PretrainedConfig, layer_type: str | None = None) -> None:
        super().__init__()
        check_rope_config(hf_config, layer_type)
        self.hf_config = hf_config
        self.layer_type = layer_type
        self.head_dim = head_dim_of(hf_config)
        self.rotary_dim = rotary_dim_of(hf_config, layer_type)
        self.max_positions = max_rope_positions(hf_config)
        self._cos: torch.Tensor | None = None  # [max_positions, rotary_dim // 2], float32
        self._sin: torch.Tensor | None = None

    @property
    def partial(self) -> bool:
        return self.rotary_dim != self.head_dim

    def _build(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, attention_scaling = _inverse_frequencies(self.hf_config, device, self.layer_type)
        if inv_freq.numel() * 2 != self.rotary_dim:
            raise ValueError(f"RoPE has {inv_freq.numel() * 2} rotary dims but expected {self.rotary_dim}.")
        t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq.to(torch.float32))
        params = get_rope_parameters(self.hf_config, self.layer_type)
        original = params.get("original_max_position_embeddings") or getattr(
            self.hf_config, "original_max_position_embeddings", None
        )
        if params["rope_type"] == "longrope" and original and self.max_positions > int(original):
            long_freq, _ = _inverse_frequencies(self.hf_config, device, self.layer_type, seq_len=self.max_positions)
            freqs[int(original) :] = torch.outer(t[int(original) :], long_freq.to(torch.float32))
        self._cos = freqs.cos() * attention_scaling
        self._sin = freqs.sin() * attention_scaling
        return self._cos, self._sin

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin tables, ``[max_positions, head_dim // 2]`` float32, on ``device``."""
        if self._cos is None or self._sin is None or self._cos.device != device:
            return self._build(device)
        return self._cos, self._sin

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype, fused: bool) -> RotaryArgs:
        """The rotation inputs for this step: whole tables for the fused kernel, else gathered rows
        (a partial rotation always takes the torch path: the kernel rotates whole heads)."""
        if fused and not self.partial:
            return RotaryArgs(positions, *self.tables(positions.device), fused=True)
        return RotaryArgs(positions, *self.cos_sin(positions, dtype), fused=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each token, ``[T, 1, head_dim // 2]`` each, ready to broadcast over heads."""
        cos_table, sin_table = self.tables(positions.device)
        cos = cos_table.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = sin_table.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]``; returns a new contiguous tensor. With tables
    narrower than half a head, only the first ``2 * cos.shape[-1]`` dims rotate.

    Same arithmetic as transformers' ``x * cos + rotate_half(x) * sin``, without building the
    doubled cos/sin tables.
    """
    if 2 * cos.shape[-1] != x.shape[-1]:
        rot = 2 * cos.shape[-1]
        return torch.cat((apply_rotary(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)
    half = x.shape[-1] // 2
    x1 = x[..., :half]
    x2 = x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotate_in_place(
    qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_dim: int
) -> None:
    """Rotates the first ``num_heads`` heads of each row of ``qkv`` (float32 on CPU, rows
    contiguous) in place; ``cos``/``sin`` are whole tables ``[max_positions, head_dim // 2]``,
    gathered by position inside the kernel. Other tensors use :func:`apply_rotary` instead."""
    ops.rotary_embedding(qkv, positions, cos, sin, num_heads, head_dim)
