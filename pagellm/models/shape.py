"""What the engine needs to know about a model's layers, read from its config once.

The executor sizes the KV cache, groups layers by attention kind and builds batches from a
:class:`ModelShape`; it never reaches into a model's modules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch

from pagellm.layers.rotary import head_dim_of
from pagellm.layers.state_shape import StateTensorShape  # the recurrent layers state what they keep

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SLIDING = "sliding_attention"
FULL = "full_attention"


def layer_sliding_windows(hf_config: PretrainedConfig) -> tuple[Optional[int], ...]:
    """Each layer's sliding window (a query attends to the ``window`` latest positions, itself
    included), or None for a layer that attends to its whole context.

    transformers 5 lists ``layer_types`` for the hybrid models (Gemma 3: five sliding to one full;
    gpt-oss: alternating; Qwen2/3: from ``max_window_layers``); Mistral-style configs give one
    ``sliding_window`` for every layer, and Qwen's ``use_sliding_window=False`` turns it off.
    """
    num_layers = int(hf_config.num_hidden_layers)
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return (None,) * num_layers
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        pattern = getattr(hf_config, "sliding_window_pattern", None)  # Gemma 3 before layer_types
        if pattern:
            layer_types = [FULL if (i + 1) % int(pattern) == 0 else SLIDING for i in range(num_layers)]
        else:
            layer_types = [SLIDING] * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"config lists {len(layer_types)} layer_types for {num_layers} layers")
    unknown = sorted(set(layer_types) - {SLIDING, FULL})
    if unknown:
        raise ValueError(f"unsupported attention layer types {unknown}; supported: {SLIDING!r}, {FULL!r}")
    return tuple(int(window) if kind == SLIDING else None for kind in layer_types)


@dataclass(frozen=True)
class ModelShape:
    """The model as the cache and the batch see it (all ranks' heads; a TP rank holds a share)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    # Per layer: its sliding window in tokens, or None for full attention (and for recurrent layers).
    layer_sliding_windows: tuple[Optional[int], ...] = ()
    # A hybrid model's recurrent layers (Gated DeltaNet, Mamba): they keep a fixed-size state per
    # request instead of KV, each layer the same ``state_tensors``.
    state_layer_ids: tuple[int, ...] = ()
    state_tensors: tuple[StateTensorShape, ...] = ()
    # Layers that hold neither KV nor state: a block that is only an MLP or MoE (Nemotron-H's).
    no_cache_layer_ids: tuple[int, ...] = ()
    # (layer, source): the layer attends over the source layer's KV and writes none of its own
    # (Gemma 4's last layers); the source holds KV and attends over the same window.
    kv_shared_layers: tuple[tuple[int, int], ...] = ()
    # Per layer (KV heads, head size) where layers differ (Gemma 4's full layers have wider heads);
    # empty: every layer has ``(num_kv_heads, head_dim)``, which are otherwise layer 0's.
    layer_kv_heads: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if not self.layer_sliding_windows:
            object.__setattr__(self, "layer_sliding_windows", (None,) * self.num_layers)
        if len(self.layer_sliding_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_sliding_windows)} sliding windows for {self.num_layers} layers")
        if any(not 0 <= i < self.num_layers for i in self.state_layer_ids) or bool(self.state_layer_ids) != bool(self.state_tensors):
            raise ValueError(f"recurrent layers {self.state_layer_ids} with state {self.state_tensors} for {self.num_layers} layers")
        if self.layer_kv_heads and len(self.layer_kv_heads) != self.num_layers:
            raise ValueError(f"KV head shapes for {len(self.layer_kv_heads)} layers, the model has {self.num_layers}")
        if not self.kv_layer_ids:
            raise ValueError("a model needs at least one attention layer that holds KV")  # the KV layout checks the rest

    @property
    def kv_layer_ids(self) -> tuple[int, ...]:
        """The layers that hold KV of their own."""
        other = set(self.state_layer_ids) | set(self.no_cache_layer_ids) | {layer for layer, _ in self.kv_shared_layers}
        return tuple(i for i in range(self.num_layers) if i not in other)

    def kv_heads_of(self, layer: int) -> tuple[int, int]:
        """(KV heads, head size) of one layer, all ranks' heads."""
        return self.layer_kv_heads[layer] if self.layer_kv_heads else (self.num_kv_heads, self.head_dim)

    @property
    def has_sliding_layers(self) -> bool:
        return any(self.layer_sliding_windows[i] is not None for i in self.kv_layer_ids)

    @property
    def is_hybrid(self) -> bool:
        return bool(self.state_layer_ids)

    @property
    def num_attention_layers(self) -> int:
        """Layers whose KV the cache holds (a layer reading another's KV not counted)."""
        return len(self.kv_layer_ids)

    def state_slot_bytes(self, conv_dtype: torch.dtype, ssm_dtype: torch.dtype, tp_size: int = 1) -> int:
        """One request's recurrent state, every recurrent layer, on one rank."""
        return len(self.state_layer_ids) * sum(t.nbytes(conv_dtype, ssm_dtype, tp_size) for t in self.state_tensors)

    @classmethod
    def from_hf_config(cls, hf_config: PretrainedConfig) -> "ModelShape":
        # Imported here: the model classes import this module.
        from pagellm.models.registry import kv_shared_layers_of, layer_kv_heads_of, no_cache_layers_of, recurrent_state_of

        num_heads = hf_config.num_attention_heads
        state_layer_ids, state_tensors = recurrent_state_of(hf_config)
        per_layer = layer_kv_heads_of(hf_config)
        if per_layer:  # the config refuses one head size for all layers
            num_kv_heads, head_dim = per_layer[0]
        else:
            num_kv_heads, head_dim = int(getattr(hf_config, "num_key_value_heads", None) or num_heads), head_dim_of(hf_config)
        return cls(
            num_layers=int(hf_config.num_hidden_layers),
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            vocab_size=int(hf_config.vocab_size),
            layer_sliding_windows=layer_sliding_windows(hf_config),
            state_layer_ids=state_layer_ids,
            state_tensors=state_tensors,
            no_cache_layer_ids=no_cache_layers_of(hf_config),
            kv_shared_layers=kv_shared_layers_of(hf_config),
            layer_kv_heads=per_layer if len(set(per_layer)) > 1 else (),
        )
