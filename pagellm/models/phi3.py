"""Phi-3 / Phi-4-mini: Llama's layout with q/k/v and gate/up stored fused in the checkpoint
(``qkv_proj``, ``gate_up_proj``: the fused layers take them whole and cut each shard), partial
rotary (Phi-4-mini rotates 3/4 of each head), LongRoPE, and a sliding window where configured."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagellm.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Phi3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def bias_flags(hf_config: PretrainedConfig) -> tuple[bool, bool, bool]:
        return False, False, False
