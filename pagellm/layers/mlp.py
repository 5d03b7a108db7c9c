"""The gated MLP (gate/up, activation, down) most decoders use, and the plain one (up, activation,
down: Nemotron-H's), tensor-parallel by Megatron's split: gate/up (up) column-parallel, down
row-parallel with one all-reduce after it."""

from __future__ import annotations

import torch
from torch import nn

from pagellm.distributed.parallel_state import get_tp_group
from pagellm.distributed.partition import split_evenly
from pagellm.layers.activation import plain_activation
from pagellm.layers.linear import GatedLinear, Linear, TPSplit


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``; ``intermediate_size`` is the whole model's (each rank holds
    an even share). ``reduce_results=False`` leaves the sum over ranks to the caller (an MoE layer
    reduces once over all its experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, bias: bool = False, reduce_results: bool = True) -> None:
        super().__init__()
        tp = get_tp_group()
        start, size = split_evenly(intermediate_size, tp.world_size)[tp.rank]
        self.intermediate_size = size
        self.gate_up_proj = GatedLinear(
            hidden_size,
            2 * size,
            bias=bias,
            shard_sizes={"gate": size, "up": size},
            tp_split=TPSplit(
                0, {"gate": (start, size), "up": (start, size)}, full_sizes={"gate": intermediate_size, "up": intermediate_size}
            ),
            activation=activation,
        )
        self.down_proj = Linear(size, hidden_size, bias=bias, tp_split=TPSplit(1, {"": (start, size)}), reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


class MLP(nn.Module):
    """``down(act(up(x)))``, no gate; split and reduced as :class:`GatedMLP`."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, bias: bool = False, reduce_results: bool = True) -> None:
        super().__init__()
        tp = get_tp_group()
        start, size = split_evenly(intermediate_size, tp.world_size)[tp.rank]
        self.intermediate_size = size
        self.act = plain_activation(activation)
        self.up_proj = Linear(hidden_size, size, bias=bias, tp_split=TPSplit(0, {"": (start, size)}))
        self.down_proj = Linear(size, hidden_size, bias=bias, tp_split=TPSplit(1, {"": (start, size)}), reduce_results=reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))
