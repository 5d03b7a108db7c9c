"""What the engine needs to know about a model's layers, read from its config once.

The executor sizes the KV cache, groups layers by attention kind and builds batches from a
:class:`ModelShape`; it never reaches into a model's modules.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from pagellm.layers.rotary import head_dim_of

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
    # Per layer: its sliding window in tokens, or None for full attention.
    layer_sliding_windows: tuple[Optional[int], ...] = ()

    def __post_init__(self) -> None:
        if not self.layer_sliding_windows:
            object.__setattr__(self, "layer_sliding_windows", (None,) * self.num_layers)
        if len(self.layer_sliding_windows) != self.num_layers:
            raise ValueError(f"{len(self.layer_sliding_windows)} sliding windows for {self.num_layers} layers")

    @property
    def has_sliding_layers(self) -> bool:
        return any(w is not None for w in self.layer_sliding_windows)

    @classmethod
    def from_hf_config(cls, hf_config: PretrainedConfig) -> "ModelShape":
        num_heads = hf_config.num_attention_heads
        return cls(
            num_layers=int(hf_config.num_hidden_layers),
            num_kv_heads=int(getattr(hf_config, "num_key_value_heads", None) or num_heads),
            head_dim=head_dim_of(hf_config),
            vocab_size=int(hf_config.vocab_size),
            layer_sliding_windows=layer_sliding_windows(hf_config),
        )
