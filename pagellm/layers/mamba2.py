"""The Mamba-2 mixer, the recurrent layer of Granite 4.0-H and Nemotron-H (transformers' ``Mamba2Mixer``,
``GraniteMoeHybridMambaLayer``, ``NemotronHMamba2Mixer``).

Per token: one projection gives the gate z, the convolution's input xBC and the time step dt; xBC goes
through a causal depthwise convolution with bias and SiLU, then splits into x (``H`` heads of ``P``)
and B, C (``G`` groups of ``N``, each shared by ``H / G`` heads). The selective state scan
(pagellm.kernels.mamba) updates a ``[P, N]`` state per head; its output goes through an RMSNorm of
``y * silu(z)`` over each group's channels and the output projection. The layer's state per request
is the convolution's input tail and those matrices, in the slot the step's :class:`StateMetadata` names.

Under tensor parallelism each rank holds a contiguous run of heads, and the groups they read: a run
of groups when ``G`` divides over the ranks, else (``G == 1``, vLLM's rule) the one group, held by
every rank, whose gated norm then sums its squares over the ranks. The input projection is
column-parallel (z, x, B, C and dt each cut), the convolution's channels and the per-head parameters
follow, the output projection is row-parallel with one all-reduce.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.attention.state_metadata import StateMetadata
from pagellm.distributed.parallel_state import get_tp_group
from pagellm.kernels import mamba, ops, recurrent
from pagellm.layers.gated_deltanet import DepthwiseConvWeight, GatedRMSNorm
from pagellm.layers.linear import Linear, TPSplit
from pagellm.layers.state_shape import StateTensorShape


def mamba2_state_shapes(
    num_heads: int, head_dim: int, num_groups: int, state_size: int, conv_kernel_size: int
) -> tuple[StateTensorShape, StateTensorShape]:
    """A Mamba-2 layer's state per request, all ranks': the convolution's last K - 1 inputs (x, B and C
    channels; B and C held whole by every rank where the groups do not divide over them) and a
    ``[P, N]`` matrix per head (the SSM state)."""
    return (
        StateTensorShape(
            (conv_kernel_size - 1, num_heads * head_dim + 2 * num_groups * state_size),
            1,
            ssm=False,
            whole_if_indivisible=((num_groups, state_size), (num_groups, state_size)),
        ),
        StateTensorShape((num_heads, head_dim, state_size), 0, ssm=True),
    )


class GroupGatedRMSNorm(GatedRMSNorm):
    """``w * rmsnorm(y * silu(z))`` with the norm over each group of ``group_size`` channels (the
    gate before the norm: transformers' ``MambaRMSNormGated``), this rank's ``dim`` channels from
    ``start`` of the checkpoint's weight. ``reduce_over_ranks``: the ranks share one group, whose
    mean square sums their channels' squares."""

    def __init__(self, dim: int, group_size: int, eps: float, start: int = 0, reduce_over_ranks: bool = False) -> None:
        super().__init__(dim, eps)
        if dim % group_size and not reduce_over_ranks:
            raise ValueError(f"{dim} gated norm channels are not whole groups of {group_size}")
        self.group_size = group_size
        self.start = start
        self.reduce_over_ranks = reduce_over_ranks

    def load_checkpoint_tensor(self, kind: str, shard: Optional[str], source: torch.Tensor) -> None:
        # A GGUF file stores the weight as [groups, group_size].
        flat = source.reshape(-1)
        if kind != "weight" or flat.shape[0] < self.start + self.weight.shape[0]:
            raise ValueError(f"gated norm weight of shape {tuple(source.shape)} does not hold channels {self.start}+{self.weight.shape[0]}")
        super().load_checkpoint_tensor(kind, shard, flat.narrow(0, self.start, self.weight.shape[0]))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if not self.reduce_over_ranks:
            return ops.group_gated_rms_norm(x, z, self.weight, self.group_size, self.eps)
        y = x.float() * F.silu(z.float())
        square_sum = get_tp_group().all_reduce(y.pow(2).sum(-1, keepdim=True))
        y = y * torch.rsqrt(square_sum / self.group_size + self.eps)
        return self.weight * y.to(x.dtype)


class Mamba2Mixer(nn.Module):
    """``hidden_size`` in and out; ``num_heads`` heads of ``head_dim`` (the inner size is their
    product), ``num_groups`` groups of B and C with ``state_size`` each; a causal convolution of
    ``conv_kernel_size`` taps; ``eps`` the gated norm's. ``time_step_limit`` clamps the time steps;
    ``chunk_size`` the scan's chunk. The checkpoint's tensors: ``in_proj`` (z, x, B, C, dt rows),
    ``conv1d`` (weight ``[C, 1, K]`` or ``[C, K]``, bias), ``dt_bias``, ``A_log`` (or ``A``, stored as
    ``-exp(A_log)``), ``D``, ``norm``, ``out_proj``."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        num_groups: int,
        state_size: int,
        conv_kernel_size: int,
        eps: float,
        conv_bias: bool = True,
        proj_bias: bool = False,
        time_step_limit: tuple[float, float] = (0.0, float("inf")),
        chunk_size: int = mamba.CHUNK_SIZE,
    ) -> None:
        super().__init__()
        tp = get_tp_group()
        if num_heads % tp.world_size or num_heads % num_groups:
            raise ValueError(f"{num_heads} Mamba heads cannot be split evenly over {tp.world_size} ranks and {num_groups} groups")
        if num_groups % tp.world_size and num_groups != 1:
            raise ValueError(f"{num_groups} Mamba groups must divide over {tp.world_size} tensor-parallel ranks, or be one")
        h = num_heads // tp.world_size
        g = num_groups // tp.world_size if num_groups % tp.world_size == 0 else num_groups
        h0, g0 = tp.rank * h, (tp.rank * g if g != num_groups else 0)
        self.num_heads, self.head_dim, self.num_groups, self.state_size = h, head_dim, g, state_size
        self.inner_size = h * head_dim
        self.conv_dim = self.inner_size + 2 * g * state_size
        self.time_step_limit = (float(time_step_limit[0]), float(time_step_limit[1]))
        self.chunk_size = chunk_size
        inner_all, groups_all = num_heads * head_dim, num_groups * state_size
        x_range, bc_range = (h0 * head_dim, self.inner_size), (g0 * state_size, g * state_size)
        sizes = {"z": self.inner_size, "x": self.inner_size, "B": g * state_size, "C": g * state_size, "dt": h}
        full = {"z": inner_all, "x": inner_all, "B": groups_all, "C": groups_all, "dt": num_heads}
        self.in_proj = Linear(
            hidden_size,
            sum(sizes.values()),
            bias=proj_bias,
            shard_sizes=sizes,
            tp_split=TPSplit(0, {"z": x_range, "x": x_range, "B": bc_range, "C": bc_range, "dt": (h0, h)}, full_sizes=full),
        )
        self.conv1d = DepthwiseConvWeight(
            ((x_range[0], self.inner_size), (inner_all + bc_range[0], bc_range[1]), (inner_all + groups_all + bc_range[0], bc_range[1])),
            conv_kernel_size,
            bias=conv_bias,
        )
        self.dt_bias = nn.Parameter(torch.ones(h))
        self.A = nn.Parameter(torch.zeros(h))  # -exp(A_log)
        self.D = nn.Parameter(torch.ones(h))
        # The scan's per-head constants in float32 from the checkpoint's values, whatever the model's dtype.
        self.f32: dict[str, torch.Tensor] = {}
        self.norm = GroupGatedRMSNorm(
            self.inner_size, inner_all // num_groups, eps, start=x_range[0], reduce_over_ranks=tp.world_size > 1 and g == num_groups == 1
        )
        self.out_proj = Linear(self.inner_size, hidden_size, bias=proj_bias, tp_split=TPSplit(1, {"": x_range}), reduce_results=True)
        self.head_start = h0
        self.loaded: set[str] = set()

    def load_checkpoint_tensor(self, kind: str, shard: Optional[str], source: torch.Tensor) -> None:
        """The layer's own per-head tensors (this rank's heads): ``dt_bias``, ``D``, and ``A_log`` or
        ``A`` (a GGUF file's ``-exp(A_log)``); shapes ``[H]`` or ``[H, 1]``."""
        flat = source.reshape(-1)
        if kind not in ("dt_bias", "D", "A_log", "A") or source.numel() != self.num_heads * get_tp_group().world_size:
            raise ValueError(f"Mamba-2 has no parameter {kind!r} of shape {tuple(source.shape)}")
        mine = flat.narrow(0, self.head_start, self.num_heads).float()
        if kind == "A_log":
            kind, mine = "A", -torch.exp(mine)
        param = getattr(self, kind)
        param.data.copy_(mine)
        self.f32[kind] = mine.to(param.device, copy=True)
        self.loaded.add(kind)

    def missing_weights(self) -> list[str]:
        return [name for name in ("dt_bias", "A", "D") if name not in self.loaded]

    def forward(
        self, hidden: torch.Tensor, rope: object, state: tuple[torch.Tensor, torch.Tensor], metadata: StateMetadata
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        z, xbc, dt = self.in_proj(hidden).split([self.inner_size, self.conv_dim, self.num_heads], dim=-1)
        conv_state, ssm_state = state
        md = metadata
        xbc = recurrent.causal_conv1d(
            xbc, self.conv1d.weight, self.conv1d.bias, conv_state, md.query_start_loc, md.slot_ids,
            md.has_initial_state, md.checkpoints,
        )
        bc_size = self.num_groups * self.state_size
        x, B, C = xbc.split([self.inner_size, bc_size, bc_size], dim=-1)
        y = mamba.selective_state_scan(
            x.view(num_tokens, self.num_heads, self.head_dim),
            dt,
            self.f32["A"],
            B.view(num_tokens, self.num_groups, self.state_size),
            C.view(num_tokens, self.num_groups, self.state_size),
            self.f32["D"],
            self.f32["dt_bias"],
            ssm_state,
            md.query_start_loc,
            md.slot_ids,
            md.has_initial_state,
            md.checkpoints,
            dt_limit=self.time_step_limit,
            chunk_size=self.chunk_size,
        )
        y = self.norm(y.reshape(num_tokens, self.inner_size), z)
        return self.out_proj(y)
