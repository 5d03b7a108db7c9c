"""The layers models share: linear projections, RMSNorm, SiLU-and-multiply, rotary embedding.

Each has two paths with the same arithmetic: a C++ kernel (:mod:`pagellm.kernels.ops`) for
float32 tensors on CPU, and plain torch for everything else (other devices and dtypes, or when
the kernels could not be built); ``ops`` decides which. In eager torch the elementwise layers are
a dozen small ops per block, each a dispatch, an allocation and a pass over memory, which at
decode batch sizes costs about as much as attention. Linear layers hold their weight in the form
their method (pagellm.models.linear_method) multiplies with.
"""
from __future__ import annotations

from typing import Optional, overload

import torch
from torch import nn
from torch.nn import functional as F

from pagellm.config import EXACT_LINEAR, LinearPrecision
from pagellm.distributed.parallel_state import get_tp_group
from pagellm.kernels import ops
from pagellm.kernels.tuning import CpuTuning
from pagellm.models.gguf_types import GGUFWeight, dequantize_rows, kernel_takes
from pagellm.models.linear_method import GGUFInt8Method, LinearMethod, WeightSource, create_linear_method


class Linear(nn.Module):
    """A linear layer whose weight arrives as stored in the checkpoint and is then held in the one
    form its :class:`~pagellm.models.linear_method.LinearMethod` computes with.

    ``shard_sizes`` names the row blocks of a fused projection (q/k/v, gate/up) in order; the
    checkpoint's separate tensors load into them with :meth:`load_shard`, and
    :meth:`process_weights_after_loading` builds the method (and frees the loaded tensors). Only
    the bias is a parameter; a dense method's weight is reachable as ``.weight``.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, shard_sizes: Optional[dict[str, int]] = None
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.shard_sizes = dict(shard_sizes) if shard_sizes else {"": out_features}
        if sum(self.shard_sizes.values()) != out_features:
            raise ValueError(f"shards {self.shard_sizes} do not add up to {out_features} rows")
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.method: Optional[LinearMethod] = None
        self._loaded: dict[str, WeightSource] = {}

    silu_and_mul = False

    def shard_range(self, shard: Optional[str]) -> tuple[int, int]:
        """(row offset, rows) of one shard (None or "": the whole weight)."""
        offset = 0
        for name, rows in self.shard_sizes.items():
            if name == (shard or ""):
                return offset, rows
            offset += rows
        raise ValueError(f"no shard {shard!r} in {list(self.shard_sizes)}")

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

    def process_weights_after_loading(
        self, precision: LinearPrecision = EXACT_LINEAR, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
    ) -> int:
        """Builds the method from the loaded shards, which are then dropped; returns its bytes."""
        if self.missing_shards:
            raise ValueError(f"weight shards never loaded: {self.missing_shards}")
        sources = [self._loaded[name] for name in self.shard_sizes]
        self._loaded = {}
        self.method = create_linear_method(
            sources, precision, torch.device(device), dtype, silu_and_mul=self.silu_and_mul, has_bias=self.bias is not None
        )
        return self.method.nbytes

    @property
    def weight(self) -> torch.Tensor:
        """The dense weight, for a layer whose method keeps one (the exact path)."""
        weight = getattr(self.method, "weight", None)
        if weight is None:
            raise AttributeError(f"this layer holds its weight as {self.method.form if self.method else 'nothing yet'}")
        return weight

    def use_cpu_tuning(self, tuning: CpuTuning) -> None:
        if self.method is not None:
            self.method.use_cpu_tuning(tuning)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(x, self.bias)

    def extra_repr(self) -> str:
        form = self.method.form if self.method is not None else "not loaded"
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {form}"


class SiluAndMulLinear(Linear):
    """A gate/up projection (weight ``[2d, K]``, gate rows first) whose forward returns
    ``silu(gate) * up``, ``[T, d]``: the product and the activation in one pass where it can."""

    silu_and_mul = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply_silu_mul(x, self.bias)


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


class VocabParallelEmbedding(nn.Module):
    """The embedding table, split by vocabulary rows under tensor parallelism (padded to equal
    pieces): each rank looks up the ids it holds, zeros the others, and one all-reduce sums them.

    A GGUF table stays in its blocks on a CPU and only the looked-up rows are dequantized (by the
    same dequantizer as everything else, so values are exact); a float table stays in its dtype
    and rows are returned as float32. A tied LM head is built from :meth:`source_rows`.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, vocab_start: int = 0, vocab_size: Optional[int] = None) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.vocab_start = vocab_start
        self.vocab_size = vocab_size if vocab_size is not None else num_embeddings
        self.dense: Optional[torch.Tensor] = None
        self.blocks: Optional[GGUFWeight] = None
        # On the int8 path the table lives only in the kernel's panels, shared with a tied head.
        self.packed: Optional[GGUFInt8Method] = None
        self.out_dtype = torch.float32  # the model's activations' dtype

    @property
    def loaded(self) -> bool:
        return self.dense is not None or self.blocks is not None or self.packed is not None

    @property
    def weight(self) -> torch.Tensor:
        """The table as float32 ``[rows, dim]`` (dequantized: a copy for a GGUF table)."""
        if self.packed is not None:
            return self._lookup(torch.arange(self.num_embeddings))
        if self.blocks is not None:
            return pad_rows(self.blocks.dequantize(), self.num_embeddings)
        return self.dense.float()

    @property
    def nbytes(self) -> int:
        if self.packed is not None:
            return self.packed.nbytes
        if self.blocks is not None:
            return self.blocks.nbytes
        return 0 if self.dense is None else self.dense.numel() * self.dense.element_size()

    def load(self, source: WeightSource) -> None:
        """Takes this rank's rows of the table as stored."""
        if source.shape[1] != self.embedding_dim or source.shape[0] > self.num_embeddings:
            raise ValueError(f"embedding has shape {tuple(source.shape)}, expected ({self.num_embeddings}, {self.embedding_dim})")
        if isinstance(source, GGUFWeight):
            self.blocks = source
        else:
            self.dense = pad_rows(source, self.num_embeddings).contiguous()

    def process_weights_after_loading(
        self, device: torch.device | str, dtype: torch.dtype, precision: LinearPrecision = EXACT_LINEAR
    ) -> None:
        """Rows come out in ``dtype``; off the CPU the table is dense on ``device`` in it. On the
        int8 path a GGUF table the kernel takes is repacked into its panels (rows padded to the
        table's size, so a tied head can multiply by the very same panels)."""
        self.out_dtype = dtype
        if torch.device(device).type == "cpu":
            if precision.kind == "int8" and self.blocks is not None and kernel_takes(self.blocks.ggml_type):
                self.packed = GGUFInt8Method(self.blocks.pad_rows(self.num_embeddings))
                self.blocks = None
            return
        if self.blocks is not None:
            self.dense, self.blocks = pad_rows(self.blocks.dequantize(), self.num_embeddings), None
        self.dense = self.dense.to(device=device, dtype=dtype).contiguous()

    def source_rows(self, rows: int) -> WeightSource:
        """The table as stored, padded to ``rows``, for a tied LM head to pack from."""
        return pad_rows(self.blocks, rows) if self.blocks is not None else pad_rows(self.dense, rows)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            rows = ops.int8_rows(self.packed.packed, int(self.packed.ggml_type), self.embedding_dim, ids.cpu())
            return rows.to(ids.device, self.out_dtype)
        if self.blocks is not None:
            rows = self.blocks.data.index_select(0, ids.cpu().clamp_(0, self.blocks.rows - 1))
            return dequantize_rows(rows, self.blocks.ggml_type, self.embedding_dim).to(ids.device, self.out_dtype)
        return F.embedding(ids, self.dense).to(self.out_dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_size)
        out = self._lookup(local.masked_fill(outside, 0))
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(out)


class RMSNorm(nn.Module):
    """RMSNorm with the pre-norm residual add folded in, as vLLM's.

    ``norm(x)`` returns the normalised ``x``. ``norm(x, residual)`` first adds ``x`` to the
    residual stream and returns ``(normalised stream, stream)``; both inputs are overwritten (the
    caller owns them: they are the previous sublayer's fresh output and the running stream).
    """

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` for the fused gate/up projection output ``[T, 2d]``."""
    return ops.silu_and_mul(x)


def rotate_in_place(
    qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_dim: int
) -> None:
    """Rotates the first ``num_heads`` heads of each row of ``qkv`` (float32 on CPU, rows
    contiguous) in place; ``cos``/``sin`` are whole tables ``[max_positions, head_dim // 2]``,
    gathered by position inside the kernel. Other tensors use :func:`apply_rotary` instead."""
    ops.rotary_embedding(qkv, positions, cos, sin, num_heads, head_dim)
