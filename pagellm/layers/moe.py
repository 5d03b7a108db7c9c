"""A mixture-of-experts MLP: a router picks ``top_k`` experts per token, and each expert (a gated
MLP) runs once per step on all the tokens routed to it, so its weights stream from memory once
however many tokens chose it.

Routing follows transformers' Mixtral / Qwen-MoE: softmax over all experts in float32, the top-k
probabilities, renormalised to sum to one when the config asks (``norm_topk_prob``; Mixtral
always). Under tensor parallelism every rank holds every expert's share of the intermediate rows
(Megatron's split inside each expert) and the layer sums the ranks' outputs with one all-reduce
for all experts together. Each expert's projections are ordinary linear layers, so a GGUF
checkpoint's expert blocks go to the same int8 kernels as a dense layer's.
"""
from __future__ import annotations

import torch
from torch import nn

from pagellm.distributed.parallel_state import get_tp_group
from pagellm.layers.linear import Linear
from pagellm.layers.mlp import GatedMLP


class FusedMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        activation: str = "silu",
        renormalize: bool = True,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and the number of experts ({num_experts})")
        self.tp = get_tp_group()
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleList(
            GatedMLP(hidden_size, intermediate_size, activation, reduce_results=False) for _ in range(num_experts)
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights ``[T, k]`` in x's dtype, expert ids ``[T, k]``) for each token."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, expert_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), expert_ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, expert_ids = self.route(x)
        out = torch.zeros_like(x)
        flat_ids = expert_ids.flatten()
        # Sorted by expert, each expert's tokens are one contiguous run of ``order``.
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of = order // self.top_k
        flat_weights = weights.flatten()
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            picks = order[start : start + count]
            rows = token_of[start : start + count]
            y = self.experts[expert](x.index_select(0, rows))
            out.index_add_(0, rows, y * flat_weights.index_select(0, picks).unsqueeze(-1))
            start += count
        return self.tp.all_reduce(out) if self.tp.world_size > 1 else out
