"""The vocabulary the GGUF architecture tables share: :class:`GGUFArch`, what one GGUF architecture
(llama.cpp's name for it) is here, and the expert and mixture-of-experts key tables that both
gguf_arch (the attention-only architectures) and gguf_hybrid_arch (the recurrent hybrids) build on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class GGUFArch:
    model_type: str  # transformers' config model_type
    architecture: str  # config.architectures[0]
    mapping_key: str  # the key of transformers' GGUF_CONFIG_MAPPING for the metadata
    # Metadata keys (after the arch prefix) transformers' mapping lacks -> config field.
    extra_keys: dict[str, str] = field(default_factory=dict)
    # GGUF block tensor -> HF module under model.layers.N, where this arch differs from Llama's.
    block_names: dict[str, str] = field(default_factory=dict)
    # Norm weights llama.cpp stored with 1 added (Gemma's (1 + w) norms), undone on load.
    norm_shift: float = 0.0
    # Which HF MLP module holds the experts, and the expert projections' names.
    moe_module: Optional[str] = None
    expert_names: dict[str, str] = field(default_factory=dict)
    # Norms stored as they are despite norm_shift (Qwen3.5's gated norm, a plain weight).
    plain_norms: frozenset[str] = frozenset()
    # The converter's layout of the linear-attention layers: "qwen3next" or "qwen35" (gguf_hybrid_arch's docstring).
    linear_attention: Optional[str] = None
    # Top-level tensors this arch names otherwise (LFM2's final norm is token_embd_norm).
    top_level_names: dict[str, str] = field(default_factory=dict)
    # Block tensors whose HF name has no ".weight" beyond SUFFIXLESS's (GGUF kind -> HF parameter).
    suffixless: dict[str, str] = field(default_factory=dict)


QWEN_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
MIXTRAL_EXPERTS = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}
MOE_KEYS = {"expert_count": "num_experts", "expert_used_count": "num_experts_per_tok"}
