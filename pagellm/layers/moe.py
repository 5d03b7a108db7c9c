"""A mixture-of-experts MLP: a router picks ``top_k`` experts per token, and each expert (a gated
MLP) runs once per step on all the tokens routed to it, so its weights stream from memory once
however many tokens chose it.

Routing follows transformers: Mixtral / Qwen-MoE take the softmax over all experts in float32,
then the top-k probabilities, renormalised to sum to one when the config asks (``norm_topk_prob``;
Mixtral always); gpt-oss takes the top-k logits (its router has a bias), then their softmax.
``scoring="sigmoid"`` (DeepSeek-V3, LFM2-MoE, Nemotron-H) scores each expert by the sigmoid of its
logit; with ``e_score_correction_bias`` a learnt per-expert bias is added to the scores to choose the
top k only, the weights being the chosen experts' unbiased scores (then renormalised if asked); a
``routed_scaling_factor`` multiplies the final weights. With ``num_expert_groups`` > 1 (DeepSeek-V3's
and Nemotron-H's grouped routing) the experts fall in equal groups, each scored by the sum of its two
best (biased) scores, and the top k are chosen within the ``num_groups_used`` best groups only.
``gated=False`` makes each expert a plain MLP (up, activation, down: Nemotron-H's squared ReLU).

Under tensor parallelism every rank holds every expert's share of the intermediate rows
(Megatron's split inside each expert) and the layer sums the ranks' outputs with one all-reduce
for all experts together. Each expert's projections are ordinary linear layers, so a GGUF
checkpoint's expert blocks go to the same int8 kernels as a dense layer's.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from pagellm.distributed.parallel_state import get_tp_group
from pagellm.kernels import ops
from pagellm.layers.linear import Linear
from pagellm.layers.linear_method import GGUFInt8Method
from pagellm.layers.mlp import MLP, GatedMLP


class Experts(nn.ModuleList):
    """The experts, one :class:`GatedMLP` each. Loads per-expert checkpoint tensors by name, or
    gpt-oss's stacked ones: ``gate_up_proj`` ``[experts, hidden, 2 * inter]`` with gate and up
    columns interleaved, ``down_proj`` ``[experts, inter, hidden]`` (both input-major), and their
    biases ``[experts, rows]``."""

    def load_checkpoint_tensor(self, kind: str, shard: Optional[str], source: torch.Tensor) -> None:
        if kind not in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias") or source.shape[0] != len(self):
            raise ValueError(f"no stacked expert tensor {kind!r} of shape {tuple(source.shape)}")
        for expert, part in zip(self, source):
            if kind == "gate_up_proj":
                weight = part.t()
                expert.gate_up_proj.load_checkpoint_tensor("weight", "gate", weight[0::2].contiguous())
                expert.gate_up_proj.load_checkpoint_tensor("weight", "up", weight[1::2].contiguous())
            elif kind == "gate_up_proj_bias":
                expert.gate_up_proj.load_checkpoint_tensor("bias", "gate", part[0::2])
                expert.gate_up_proj.load_checkpoint_tensor("bias", "up", part[1::2])
            elif kind == "down_proj":
                expert.down_proj.load_checkpoint_tensor("weight", None, part.t().contiguous())
            else:
                expert.down_proj.load_checkpoint_tensor("bias", None, part)


class FusedMoE(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        activation: str = "silu",
        renormalize: bool = True,
        softmax_after_topk: bool = False,
        bias: bool = False,
        router_name: str = "gate",
        scoring: str = "softmax",
        e_score_correction_bias: bool = False,
        routed_scaling_factor: float = 1.0,
        num_expert_groups: int = 1,
        num_groups_used: int = 1,
        gated: bool = True,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and the number of experts ({num_experts})")
        if scoring not in ("softmax", "sigmoid") or (scoring == "sigmoid" and softmax_after_topk):
            raise ValueError(f"expert scoring {scoring!r} (softmax_after_topk={softmax_after_topk}) is not supported: softmax or sigmoid")
        if num_expert_groups > 1 and (num_experts % num_expert_groups or num_experts // num_expert_groups < 2 or softmax_after_topk):
            raise ValueError(f"{num_experts} experts cannot be routed in {num_expert_groups} groups of at least two")
        if not 1 <= num_groups_used <= num_expert_groups:
            raise ValueError(f"topk_group ({num_groups_used}) must be between 1 and the number of expert groups ({num_expert_groups})")
        self.tp = get_tp_group()
        self.num_experts = num_experts
        self.num_expert_groups, self.num_groups_used = num_expert_groups, num_groups_used
        self.gated = gated
        self.top_k = top_k
        self.renormalize = renormalize
        self.softmax_after_topk = softmax_after_topk
        self.scoring = scoring
        self.routed_scaling_factor = float(routed_scaling_factor)
        # The correction bias (one per expert, float32 as routers keep it): a plain tensor filled at
        # load, not a parameter, so the model's dtype does not round it; None until loaded.
        self.wants_correction_bias = e_score_correction_bias
        self.e_score_correction_bias: Optional[torch.Tensor] = None
        # Registered under the checkpoint's name for it (gpt-oss: router).
        self.router_name = router_name
        self.add_module(router_name, Linear(hidden_size, num_experts, bias=bias))
        expert = GatedMLP if gated else MLP
        self.experts = Experts(
            expert(hidden_size, intermediate_size, activation, bias=bias, reduce_results=False) for _ in range(num_experts)
        )
        # What ops.moe_int8 takes of the experts, and the methods it was read from (None: not looked at yet).
        self._int8_experts: Optional[tuple] = None

    def load_checkpoint_tensor(self, kind: str, shard: Optional[str], source: torch.Tensor) -> None:
        """The layer's own tensor: the routing's ``e_score_correction_bias`` ``[experts]`` (every rank all of it)."""
        if kind != "e_score_correction_bias" or not self.wants_correction_bias or tuple(source.shape) != (self.num_experts,):
            raise ValueError(f"mixture of experts has no {kind!r} of shape {tuple(source.shape)}")
        self.e_score_correction_bias = source.detach().to(torch.float32, copy=True)

    def missing_weights(self) -> list[str]:
        return ["e_score_correction_bias"] if self.wants_correction_bias and self.e_score_correction_bias is None else []

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights ``[T, k]`` in x's dtype, expert ids ``[T, k]``) for each token."""
        logits = self._modules[self.router_name](x).float()
        if self.softmax_after_topk:
            top, expert_ids = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1).to(x.dtype), expert_ids
        scores = torch.sigmoid(logits) if self.scoring == "sigmoid" else torch.softmax(logits, dim=-1)
        if self.wants_correction_bias or self.num_expert_groups > 1:
            choice = scores
            if self.wants_correction_bias:
                if self.e_score_correction_bias.device != scores.device:
                    self.e_score_correction_bias = self.e_score_correction_bias.to(scores.device)
                choice = scores + self.e_score_correction_bias
            if self.num_expert_groups > 1:
                choice = self._in_best_groups(choice)
            expert_ids = torch.topk(choice, self.top_k, dim=-1).indices
            weights = scores.gather(1, expert_ids)
        else:
            weights, expert_ids = torch.topk(scores, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.routed_scaling_factor != 1.0:
            weights = weights * self.routed_scaling_factor
        return weights.to(x.dtype), expert_ids

    def _in_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """``choice`` ``[T, experts]`` with every expert outside each token's ``num_groups_used`` best
        groups (a group's score: the sum of its two best) set to -inf."""
        groups = choice.view(choice.shape[0], self.num_expert_groups, -1)
        group_scores = groups.topk(2, dim=-1).values.sum(dim=-1)
        best = torch.topk(group_scores, self.num_groups_used, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return groups.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)

    def _int8_args(self) -> Optional[tuple[list[torch.Tensor], int, list[torch.Tensor], int]]:
        """(gate_up panels, type, down panels, type) when every expert is two int8-kernel methods
        that ``ops.moe_int8`` runs in one call (gate_up with the fused activation, no biases, one
        type per projection); else None. Read once per loaded weights: a reload makes new methods."""
        if not self.gated:
            return None
        first, last = self.experts[0], self.experts[-1]
        key = (first.gate_up_proj.method, last.down_proj.method)
        if self._int8_experts is not None and self._int8_experts[0] == key:
            return self._int8_experts[1]
        args = None
        gate_ups = [e.gate_up_proj.method for e in self.experts]
        downs = [e.down_proj.method for e in self.experts]
        if (
            all(isinstance(m, GGUFInt8Method) and m.fused_gate_up for m in gate_ups)
            and all(isinstance(m, GGUFInt8Method) and not m.fused_gate_up for m in downs)
            and all(e.gate_up_proj.bias is None and e.down_proj.bias is None for e in self.experts)
            and len({m.ggml_type for m in gate_ups}) == 1
            and len({m.ggml_type for m in downs}) == 1
            and ops.moe_int8_available()
        ):
            args = ([m.packed for m in gate_ups], int(gate_ups[0].ggml_type), [m.packed for m in downs], int(downs[0].ggml_type))
        self._int8_experts = (key, args)
        return args

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        weights, expert_ids = self.route(x)
        flat_ids = expert_ids.flatten()
        # Picks sorted by expert: each expert's tokens are one contiguous run of rows, gathered
        # once for all experts, and its outputs land in the same rows.
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts)
        inputs = x.index_select(0, order // self.top_k)
        outputs = torch.empty_like(inputs)
        int8_args = self._int8_args() if ops.supports(x) else None
        if int8_args is not None:
            # Every used expert's two products in one native call, its threads shared across experts.
            gate_up, gate_up_type, down, down_type = int8_args
            ops.moe_int8(outputs, inputs, gate_up, gate_up_type, down, down_type, counts, self.experts[0].gate_up_proj.activation)
        else:
            start = 0
            for expert, count in enumerate(counts.tolist()):
                if count:
                    outputs[start : start + count] = self.experts[expert](inputs[start : start + count])
                    start += count
        # Back in (token, pick) order, then each token's picks weighted and summed.
        picked = torch.empty_like(outputs).index_copy_(0, order, outputs).view(num_tokens, self.top_k, -1)
        out = torch.bmm(weights.unsqueeze(1), picked).squeeze(1)
        return self.tp.all_reduce(out) if self.tp.world_size > 1 else out
