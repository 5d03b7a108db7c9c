"""LFM2's gated short convolution, the token mixer of its ``conv`` layers.

Per token one projection gives three gates' worth of channels, ``B``, ``C`` and ``x``; ``B * x``
goes through a causal depthwise convolution of ``L_cache`` taps (no activation, a bias where the
config has ``conv_bias``), and ``C`` times its output goes through the output projection. The
layer's state per request is the convolution's last ``L_cache - 1`` inputs, in the slot the step's
:class:`StateMetadata` names, so a sequence continues from where its previous step left it.

Under tensor parallelism each rank holds a contiguous run of the channels: the input projection is
column-parallel (``B``, ``C`` and ``x`` each cut to the run), the convolution's taps and its state
follow, the output projection is row-parallel with one all-reduce.
"""
from __future__ import annotations

import torch
from torch import nn

from pagellm.attention.state_metadata import StateMetadata
from pagellm.distributed.parallel_state import get_tp_group
from pagellm.kernels import recurrent
from pagellm.layers.gated_deltanet import DepthwiseConvWeight
from pagellm.layers.linear import Linear, TPSplit


class ShortConv(nn.Module):
    """``out_proj(C * conv(B * x))``; its state tensor per request is ``[conv_size - 1, hidden_size]``
    (this rank's channels of the last dim), in the activations' dtype."""

    def __init__(self, hidden_size: int, conv_size: int, bias: bool) -> None:
        super().__init__()
        tp = get_tp_group()
        if hidden_size % tp.world_size:
            raise ValueError(f"{hidden_size} short-convolution channels cannot be split evenly over {tp.world_size} tensor-parallel ranks")
        width = hidden_size // tp.world_size
        channels = (tp.rank * width, width)
        self.width = width
        self.in_proj = Linear(
            hidden_size,
            3 * width,
            bias=bias,
            shard_sizes={"B": width, "C": width, "x": width},
            tp_split=TPSplit(0, {"B": channels, "C": channels, "x": channels}, full_sizes=dict.fromkeys("BCx", hidden_size)),
        )
        self.conv = DepthwiseConvWeight((channels,), conv_size, bias)
        self.out_proj = Linear(width, hidden_size, bias=bias, tp_split=TPSplit(1, {"": channels}), reduce_results=True)

    def forward(self, hidden: torch.Tensor, rope: object, state: tuple[torch.Tensor], metadata: StateMetadata) -> torch.Tensor:
        b, c, x = self.in_proj(hidden).split(self.width, dim=-1)
        (conv_state,) = state
        md = metadata
        y = recurrent.causal_conv1d(
            (b * x).contiguous(), self.conv.weight, self.conv.bias, conv_state,
            md.query_start_loc, md.slot_ids, md.has_initial_state, md.checkpoints, activation=None,
        )
        return self.out_proj(c * y)
