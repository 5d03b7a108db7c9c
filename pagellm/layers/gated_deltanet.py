"""Gated DeltaNet, the linear-attention layer of Qwen3-Next and Qwen3.5 (three of every four layers).

Per token: one projection gives q, k, v (through a causal depthwise convolution with SiLU), the
output gate z, and per value head the write strength ``beta = sigmoid(b)`` and the decay
``g = -exp(A_log) * softplus(a + dt_bias)``. The gated delta rule then updates a ``[Dk, Dv]``
state per value head (pagellm.kernels.recurrent), and its output goes through an RMSNorm gated by
``silu(z)`` and the output projection. The layer's state per request is the convolution's input
tail and those matrices, in the slot the step's :class:`StateMetadata` names.

Under tensor parallelism each rank holds a contiguous run of key heads and the value heads that
read them: the input projection is column-parallel (its q, k, v, z, b, a parts each cut by heads),
the convolution's channels and the per-head parameters follow, the output projection is
row-parallel with one all-reduce.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagellm.attention.state_metadata import StateMetadata
from pagellm.distributed.parallel_state import get_tp_group
from pagellm.kernels import ops, recurrent
from pagellm.layers.gguf_types import GGUFWeight
from pagellm.layers.linear import Linear, TPSplit
from pagellm.layers.linear_method import WeightSource


class InterleavedProjection(Linear):
    """A fused projection whose ``interleaved`` checkpoint tensors hold several shards' rows grouped
    by key head, each group every shard's rows for that head (Qwen3-Next's ``in_proj_qkvz``);
    ``interleaved[name]`` is (the shards, their rows per head)."""

    def __init__(self, *args, interleaved: dict[str, tuple[tuple[str, ...], tuple[int, ...]]], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.interleaved = interleaved

    def load_checkpoint_tensor(self, kind: str, shard: Optional[str], source: WeightSource) -> None:
        if shard not in self.interleaved:
            super().load_checkpoint_tensor(kind, shard, source)
            return
        names, rows = self.interleaved[shard]
        dense = source.dequantize() if isinstance(source, GGUFWeight) else source
        pieces = torch.split(dense.reshape(-1, sum(rows), *dense.shape[1:]), list(rows), dim=1)
        for name, piece in zip(names, pieces):
            super().load_checkpoint_tensor(kind, name, piece.reshape(-1, *dense.shape[1:]).contiguous())


class DepthwiseConvWeight(nn.Module):
    """A depthwise causal convolution's taps ``[C, K]`` (the checkpoint's ``conv1d.weight`` ``[C, 1, K]``)
    and, with ``bias``, its bias ``[C]`` (Mamba's), this rank's channels: ``channel_ranges`` of the
    checkpoint's, in order."""

    def __init__(self, channel_ranges: tuple[tuple[int, int], ...], kernel_size: int, bias: bool = False) -> None:
        super().__init__()
        self.channel_ranges = channel_ranges
        channels = sum(rows for _, rows in channel_ranges)
        self.weight = nn.Parameter(torch.zeros(channels, kernel_size))
        self.bias = nn.Parameter(torch.zeros(channels)) if bias else None
        self.loaded: set[str] = set()

    def load_checkpoint_tensor(self, kind: str, shard: Optional[str], source: torch.Tensor) -> None:
        dest = self.weight if kind == "weight" else self.bias if kind == "bias" else None
        values = source.reshape(source.shape[0], -1) if kind == "weight" else source.reshape(-1, 1)
        if dest is None or values.shape[1] != (dest.shape[1] if dest.dim() == 2 else 1) or values.shape[0] < max(
            s + n for s, n in self.channel_ranges
        ):
            raise ValueError(f"conv1d {kind} of shape {tuple(source.shape)} does not match the layer's")
        dest.data.copy_(torch.cat([values.narrow(0, start, rows) for start, rows in self.channel_ranges]).reshape(dest.shape))
        self.loaded.add(kind)

    def missing_weights(self) -> list[str]:
        return [name for name in ("weight", "bias") if getattr(self, name) is not None and name not in self.loaded]


class GatedRMSNorm(nn.Module):
    """``rmsnorm(x) * w * silu(z)`` over each head's ``Dv`` values (a plain weight, not ``1 + w``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.loaded = False

    def load_checkpoint_tensor(self, kind: str, shard: Optional[str], source: torch.Tensor) -> None:
        if kind != "weight" or tuple(source.shape) != tuple(self.weight.shape):
            raise ValueError(f"gated norm weight of shape {tuple(source.shape)}, expected {tuple(self.weight.shape)}")
        self.weight.data.copy_(source)
        self.loaded = True

    def missing_weights(self) -> list[str]:
        return [] if self.loaded else ["weight"]

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = ops.rms_norm(x, self.weight, self.eps)  # transformers' order: normalised, cast, times w
        if y.dtype == torch.float32:
            return y.mul_(F.silu(z))
        return (y.float() * F.silu(z.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel_size: int,
        eps: float,
        interleaved_projection: bool = False,
    ) -> None:
        super().__init__()
        tp = get_tp_group()
        if num_k_heads % tp.world_size or num_v_heads % tp.world_size or num_v_heads % num_k_heads:
            raise ValueError(
                f"{num_k_heads} key and {num_v_heads} value heads cannot be split evenly over {tp.world_size} tensor-parallel ranks"
            )
        hk, hv = num_k_heads // tp.world_size, num_v_heads // tp.world_size
        k0, v0 = tp.rank * hk, tp.rank * hv
        self.num_k_heads, self.num_v_heads = hk, hv
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = hk * head_k_dim, hv * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        sizes = {"q": self.key_dim, "k": self.key_dim, "v": self.value_dim, "z": self.value_dim, "b": hv, "a": hv}
        key_range, value_range = (k0 * head_k_dim, self.key_dim), (v0 * head_v_dim, self.value_dim)
        full = {
            "q": num_k_heads * head_k_dim, "k": num_k_heads * head_k_dim, "v": num_v_heads * head_v_dim,
            "z": num_v_heads * head_v_dim, "b": num_v_heads, "a": num_v_heads,
        }
        rep = num_v_heads // num_k_heads
        self.in_proj = InterleavedProjection(
            hidden_size,
            sum(sizes.values()),
            shard_sizes=sizes,
            tp_split=TPSplit(
                0,
                {"q": key_range, "k": key_range, "v": value_range, "z": value_range, "b": (v0, hv), "a": (v0, hv)},
                full_sizes=full,
            ),
            parts={"qkv": ("q", "k", "v"), "qkvz": ("q", "k", "v", "z"), "ba": ("b", "a")},
            interleaved={
                "qkvz": (("q", "k", "v", "z"), (head_k_dim, head_k_dim, rep * head_v_dim, rep * head_v_dim)),
                "ba": (("b", "a"), (rep, rep)),
            }
            if interleaved_projection
            else {},
        )
        # The convolution's channels in this rank's order: its q, k and v heads.
        key_all = num_k_heads * head_k_dim
        self.conv1d = DepthwiseConvWeight(
            ((k0 * head_k_dim, self.key_dim), (key_all + k0 * head_k_dim, self.key_dim), (2 * key_all + v0 * head_v_dim, self.value_dim)),
            conv_kernel_size,
        )
        self.dt_bias = nn.Parameter(torch.ones(hv))
        self.A_log = nn.Parameter(torch.zeros(hv))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = Linear(self.value_dim, hidden_size, tp_split=TPSplit(1, {"": value_range}), reduce_results=True)
        self.value_head_start = v0
        self.loaded: set[str] = set()

    def load_checkpoint_tensor(self, kind: str, shard: Optional[str], source: torch.Tensor) -> None:
        """The layer's own per-value-head tensors, ``dt_bias`` and ``A_log`` (this rank's heads)."""
        if kind not in ("dt_bias", "A_log") or source.shape[0] != self.num_v_heads * get_tp_group().world_size:
            raise ValueError(f"Gated DeltaNet has no parameter {kind!r} of shape {tuple(source.shape)}")
        getattr(self, kind).data.copy_(source.narrow(0, self.value_head_start, self.num_v_heads))
        self.loaded.add(kind)
        # The decay's per-head constants in float32, from the parameters as stored: once, not every step.
        self.neg_a = -torch.exp(self.A_log.float())
        self.dt_bias_f32 = self.dt_bias.float()

    def missing_weights(self) -> list[str]:
        return [name for name in ("dt_bias", "A_log") if name not in self.loaded]

    def forward(
        self, hidden: torch.Tensor, rope: object, state: tuple[torch.Tensor, torch.Tensor], metadata: StateMetadata
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        proj = self.in_proj(hidden)
        mixed, z, b, a = proj.split([self.conv_dim, self.value_dim, self.num_v_heads, self.num_v_heads], dim=-1)
        conv_state, ssm_state = state
        md = metadata
        mixed = recurrent.causal_conv1d(
            mixed, self.conv1d.weight, None, conv_state, md.query_start_loc, md.slot_ids, md.has_initial_state, md.checkpoints
        )
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.view(num_tokens, self.num_k_heads, self.head_k_dim)
        k = k.view(num_tokens, self.num_k_heads, self.head_k_dim)
        v = v.view(num_tokens, self.num_v_heads, self.head_v_dim)
        beta = torch.sigmoid(b.float())
        g = self.neg_a * F.softplus(a.float() + self.dt_bias_f32)
        out = recurrent.gated_delta_rule(
            q, k, v, g, beta, ssm_state, md.query_start_loc, md.slot_ids, md.has_initial_state, md.checkpoints,
            scale=self.head_k_dim**-0.5,
        )
        out = self.norm(out.reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
        return self.out_proj(out.reshape(num_tokens, self.value_dim))
