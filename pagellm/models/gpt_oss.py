"""gpt-oss: attention with biases, a learnt sink logit per head, and a 128-token window on every
other layer; a mixture of experts in every layer whose router has a bias and takes the softmax of
the top-k logits, experts with biases and gpt-oss's clamped SwiGLU, stored stacked and input-major
in the checkpoint (``mlp.experts.gate_up_proj``, gate and up columns interleaved)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from pagellm.kernels.ops import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from pagellm.layers.moe import FusedMoE
from pagellm.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class GptOssForCausalLM(LlamaForCausalLM):
    @staticmethod
    def bias_flags(hf_config: PretrainedConfig) -> tuple[bool, bool, bool]:
        bias = bool(getattr(hf_config, "attention_bias", True))
        return bias, bias, True

    def attention_extra(self, hf_config: PretrainedConfig) -> dict:
        return {"sinks": True}

    def make_mlp(self, hf_config: PretrainedConfig, layer_idx: int) -> nn.Module:
        alpha, limit = getattr(hf_config, "swiglu_alpha", SWIGLU_OAI_ALPHA), getattr(hf_config, "swiglu_limit", SWIGLU_OAI_LIMIT)
        if (alpha, limit) != (SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT):
            raise ValueError(f"gpt-oss with swiglu_alpha={alpha}, swiglu_limit={limit} is not supported (only gpt-oss's own 1.702, 7.0)")
        return FusedMoE(
            hf_config.hidden_size,
            hf_config.num_local_experts,
            hf_config.num_experts_per_tok,
            hf_config.intermediate_size,
            "swiglu_oai",
            softmax_after_topk=True,
            bias=True,
            router_name="router",
        )
