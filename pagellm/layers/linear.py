"""Linear layers: a weight held in the form its method computes with (pagellm.layers.linear_method),
loaded from the checkpoint's tensors as stored and cut to this rank's part by the layer itself.

Tensor parallelism follows Megatron, as vLLM's layers: a column-parallel layer (q/k/v, gate/up)
holds a contiguous run of each shard's output rows, a row-parallel one (o, down) the matching input
columns, and sums the ranks' partial outputs with one all-reduce. A :class:`TPSplit` says which
run of the checkpoint tensor this rank loads; None loads all of it (one rank, or a replicated layer).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import nn

from pagellm.config import EXACT_LINEAR, LinearPrecision
from pagellm.distributed.parallel_state import get_tp_group
from pagellm.kernels import ops
from pagellm.kernels.context import KernelContext
from pagellm.layers.activation import canonical_activation, gated_activation
from pagellm.layers.gguf_types import GGUFWeight
from pagellm.layers.linear_method import LinearMethod, WeightSource, create_linear_method
from pagellm.lora.layers import LoRALayerWeights


@dataclass(frozen=True)
class TPSplit:
    """This rank's part of a checkpoint tensor: along ``dim`` (0: output rows, column-parallel; 1:
    input columns, row-parallel), ``ranges[shard] = (offset, length)``; ``pad_rows`` pads a
    vocabulary-parallel head's last piece to the rows every rank allocates."""

    dim: int
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)
    pad_rows: int = 0
    # A fused projection's shards as the checkpoint holds them (all ranks' rows), for checkpoints
    # that store the fused tensor (Phi-3's qkv_proj and gate_up_proj).
    full_sizes: dict[str, int] = field(default_factory=dict)


def narrow(source: WeightSource, dim: int, start: int, length: int) -> WeightSource:
    """Rows (``dim`` 0) or columns (1) of a weight as stored. A GGUF weight whose column cut falls
    inside its blocks is dequantized first (then that layer computes in float)."""
    if not isinstance(source, GGUFWeight):
        return source.narrow(dim, start, length)
    if dim == 0:
        return source.narrow_rows(start, length)
    try:
        return source.narrow_cols(start, length)
    except ValueError:
        return source.dequantize().narrow(1, start, length)


def pad_rows(source: WeightSource, rows: int) -> WeightSource:
    """``source`` with zero rows appended up to ``rows``."""
    if isinstance(source, GGUFWeight):
        return source.pad_rows(rows)
    if source.shape[0] == rows:
        return source
    padded = source.new_zeros((rows, *source.shape[1:]))
    padded[: source.shape[0]] = source
    return padded


class Linear(nn.Module):
    """A linear layer whose weight arrives as stored in the checkpoint and is then held in the one
    form its :class:`~pagellm.layers.linear_method.LinearMethod` computes with.

    ``shard_sizes`` names the row blocks of a fused projection (q/k/v, gate/up) in order; the
    checkpoint's separate tensors load into them (:meth:`load_checkpoint_tensor` cuts this rank's
    part, :meth:`load_shard` takes it as is), as does a tensor that holds several shards: the whole
    fused one (shard None: Phi-3's qkv_proj), or one of ``parts`` (name -> the shards it holds, in
    order: Qwen3.5's in_proj_qkv of an in_proj with z, b and a too). :meth:`process_weights_after_loading` builds the
    method (and frees the loaded tensors). ``reduce_results``: sum the ranks' outputs (row-parallel).
    Only the bias is a parameter; a dense method's weight is reachable as ``.weight``.
    """

    # For a gate/up projection: the activation whose product with up the layer returns.
    activation: Optional[str] = None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        shard_sizes: Optional[dict[str, int]] = None,
        tp_split: Optional[TPSplit] = None,
        reduce_results: bool = False,
        parts: Optional[dict[str, tuple[str, ...]]] = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.shard_sizes = dict(shard_sizes) if shard_sizes else {"": out_features}
        self.parts = dict(parts or {})
        if sum(self.shard_sizes.values()) != out_features:
            raise ValueError(f"shards {self.shard_sizes} do not add up to {out_features} rows")
        self.tp = get_tp_group()
        self.tp_split = tp_split if self.tp.world_size > 1 else None
        self.reduce_results = reduce_results and self.tp.world_size > 1
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.method: Optional[LinearMethod] = None
        self._loaded: dict[str, WeightSource] = {}
        self._bias_shards: set[str] = set()
        # Adapter pool when the engine serves LoRA (pagellm.lora.model_manager attaches it).
        self.lora: Optional[LoRALayerWeights] = None

    def shard_range(self, shard: Optional[str]) -> tuple[int, int]:
        """(row offset, rows) of one shard (None or "": the whole weight)."""
        offset = 0
        for name, rows in self.shard_sizes.items():
            if name == (shard or ""):
                return offset, rows
            offset += rows
        raise ValueError(f"no shard {shard!r} in {list(self.shard_sizes)}")

    def _cut(self, shard: Optional[str], source: WeightSource, kind: str) -> WeightSource:
        split = self.tp_split
        if split is None:
            return source
        if split.dim == 1 and kind == "bias":  # a row-parallel bias is added once, on rank 0
            return source if self.tp.rank == 0 else torch.zeros_like(source)
        part = narrow(source, split.dim, *split.ranges[shard or ""])
        if split.pad_rows:
            part = pad_rows(part, split.pad_rows)
        return part

    def load_checkpoint_tensor(self, kind: str, shard: Optional[str], source: WeightSource) -> None:
        """Takes a checkpoint tensor (``kind`` "weight" or "bias") of one shard, whole: this rank's
        part is cut from it here."""
        names = tuple(self.shard_sizes) if shard is None and len(self.shard_sizes) > 1 else self.parts.get(shard or "")
        if names:  # the checkpoint's tensor holds these shards' rows, all ranks', one after another
            full = self.tp_split.full_sizes if self.tp_split is not None else self.shard_sizes
            if sum(full[name] for name in names) != source.shape[0]:
                raise ValueError(f"fused {kind} has {source.shape[0]} rows, expected {sum(full[name] for name in names)}")
            offset = 0
            for name in names:
                self.load_checkpoint_tensor(kind, name, narrow(source, 0, offset, full[name]))
                offset += full[name]
            return
        source = self._cut(shard, source, kind)
        if kind == "weight":
            self.load_shard(shard, source)
            return
        if self.bias is None or kind != "bias":
            raise ValueError(f"this layer has no {kind}")
        dense = source.dequantize() if isinstance(source, GGUFWeight) else source
        dest = self.bias.data.narrow(0, *self.shard_range(shard))
        if dest.shape[0] > dense.shape[0] and self.tp_split is not None and self.tp_split.pad_rows:
            dest.zero_()
            dest = dest.narrow(0, 0, dense.shape[0])
        if tuple(dest.shape) != tuple(dense.shape):
            raise ValueError(f"bias has shape {tuple(dense.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(dense)
        self._bias_shards.add(shard or "")

    def load_shard(self, shard: Optional[str], source: WeightSource) -> None:
        """Takes one shard's weight as stored (this rank's rows and columns of it)."""
        _, rows = self.shard_range(shard)
        if tuple(source.shape) != (rows, self.in_features):
            raise ValueError(f"weight has shape {tuple(source.shape)}, expected {(rows, self.in_features)}")
        self._loaded[shard or ""] = source

    @property
    def missing_shards(self) -> list[str]:
        if self.method is not None:
            return []
        return [name for name in self.shard_sizes if name not in self._loaded]

    @property
    def missing_bias_shards(self) -> list[str]:
        return [] if self.bias is None else [name for name in self.shard_sizes if name not in self._bias_shards]

    def process_weights_after_loading(
        self,
        precision: LinearPrecision = EXACT_LINEAR,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        kernels: Optional[KernelContext] = None,
    ) -> int:
        """Builds the method from the loaded shards, which are then dropped; returns its bytes.
        ``kernels``: the load's :class:`KernelContext` (its pack session, this machine's tuning)."""
        if self.missing_shards:
            raise ValueError(f"weight shards never loaded: {self.missing_shards}")
        sources = [self._loaded[name] for name in self.shard_sizes]
        self._loaded = {}
        self.method = create_linear_method(
            sources,
            precision,
            torch.device(device),
            dtype,
            gate_up=self.activation in ops.FUSED_ACTIVATIONS,
            kernels=kernels,
        )
        return self.method.nbytes

    def resident_tensors(self) -> list[torch.Tensor]:
        """The weight's tensors as its method keeps them (the bias is a parameter)."""
        return [] if self.method is None else self.method.resident_tensors()

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight, for a layer whose method keeps one (the exact path)."""
        weight = getattr(self.method, "weight", None)
        if weight is None:
            raise AttributeError(f"this layer holds its weight as {self.method.form if self.method else 'nothing yet'}")
        return weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(x, self.bias)
        if self.lora is not None:
            self.lora.add_delta(out, x)
        return self.tp.all_reduce(out) if self.reduce_results else out

    def extra_repr(self) -> str:
        form = self.method.form if self.method is not None else "not loaded"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {form}"


class GatedLinear(Linear):
    """A gate/up projection (weight ``[2d, K]``, gate rows first) whose forward returns
    ``act(gate) * up``, ``[T, d]``: for the activations the kernels take (``ops.FUSED_ACTIVATIONS``:
    SiLU, GELU-tanh, gpt-oss's clamped SwiGLU) the product and the activation are one kernel pass
    where the method packs for it; others follow the product (pagellm.layers.activation)."""

    def __init__(self, *args, activation: str = "silu", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.activation = canonical_activation(activation)
        self._act = gated_activation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is not None and self.lora.active:
            # The deltas go into gate and up before the activation: the product runs unfused.
            gate_up = self.method.apply_gate_up(x, self.bias)
            self.lora.add_delta(gate_up, x)
            return self._act(gate_up)
        if self.activation in ops.FUSED_ACTIVATIONS:
            return self.method.apply_gated(x, self.bias, self.activation)
        return self._act(self.method.apply(x, self.bias))
