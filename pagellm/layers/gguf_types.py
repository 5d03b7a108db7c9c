"""GGUF's tensor types as a table, and a weight kept in its blocks as the file stores it.

Each quantized type is a row (llama.cpp's type traits): how many weights a block holds, its bytes,
and whether this build's int8 dot-product kernel takes it (``ops.int8_types()``, which repacks the
blocks once at load, ``gemm_int8.cpp``). Float32 values always come from ``gguf.quants.dequantize``,
the dequantizer transformers' GGUF load uses, so ``--dtype float32`` stays bit-identical to it.

A :class:`GGUFWeight` is a 2-D weight ``[rows, cols]`` held as uint8 ``[rows, row_bytes]``: one output
row's blocks per row. Rows can be selected, permuted and concatenated freely (tensor-parallel
column splits of q/k/v and gate/up, llama.cpp's Q/K row permutation, fused projections); columns
only at block boundaries (row-parallel o/down splits).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from pagellm.kernels import ops

# The block-quantized types pagellm serves from their blocks (when the kernel takes them); others
# are dequantized at load. Name -> (weights per block, bytes per block).
QUANTIZED_TYPES: dict[GGMLQuantizationType, tuple[int, int]] = {
    t: GGML_QUANT_SIZES[t]
    for t in (
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q2_K,
        GGMLQuantizationType.Q3_K,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    )
}
FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def block_shape(ggml_type: GGMLQuantizationType) -> tuple[int, int]:
    """(weights per block, bytes per block) of a GGUF type."""
    return GGML_QUANT_SIZES[ggml_type]


def kernel_takes(ggml_type: GGMLQuantizationType) -> bool:
    """Whether the int8 dot-product kernel of this build multiplies blocks of this type."""
    return ggml_type in QUANTIZED_TYPES and int(ggml_type) in ops.int8_types()


@dataclass
class GGUFWeight:
    """A 2-D GGUF weight in its stored blocks: ``data`` is uint8 ``[rows, row_bytes]``.

    A row permutation is kept as ``row_order`` (row i is ``stored[row_order[i]]``) until ``data``
    is asked for: a load whose packed weights are mapped from an earlier start never copies them.
    """

    ggml_type: GGMLQuantizationType
    stored: torch.Tensor
    cols: int
    row_order: Optional[torch.Tensor] = None
    _ordered: Optional[torch.Tensor] = field(default=None, init=False, repr=False, compare=False)

    @property
    def data(self) -> torch.Tensor:
        if self.row_order is None:
            return self.stored
        if self._ordered is None:
            self._ordered = self.stored.index_select(0, self.row_order)
        return self._ordered

    @property
    def rows(self) -> int:
        return self.stored.shape[0] if self.row_order is None else self.row_order.shape[0]

    @property
    def row_bytes(self) -> int:
        return self.stored.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def block_cols(self) -> int:
        return block_shape(self.ggml_type)[0]

    def dequantize(self) -> torch.Tensor:
        """Float32 ``[rows, cols]``, exactly as ``gguf.quants.dequantize`` computes it."""
        return dequantize_rows(self.data, self.ggml_type, self.cols)

    def narrow_rows(self, start: int, length: int) -> GGUFWeight:
        if self.row_order is not None:
            return GGUFWeight(self.ggml_type, self.stored, self.cols, self.row_order.narrow(0, start, length))
        return GGUFWeight(self.ggml_type, self.stored.narrow(0, start, length), self.cols)

    def narrow_cols(self, start: int, length: int) -> GGUFWeight:
        """Columns ``[start, start + length)``; ValueError unless both ends fall on block boundaries."""
        per_block, block_bytes = block_shape(self.ggml_type)
        if start % per_block or length % per_block:
            raise ValueError(f"columns {start}..{start + length} of a {self.ggml_type.name} weight cut its {per_block}-wide blocks")
        stored = self.stored.narrow(1, start // per_block * block_bytes, length // per_block * block_bytes)
        return GGUFWeight(self.ggml_type, stored, length, self.row_order)

    def permute_rows(self, order: torch.Tensor) -> GGUFWeight:
        """Rows in ``order`` (row i is row ``order[i]`` of this weight), copied only when read."""
        return GGUFWeight(self.ggml_type, self.stored, self.cols, order if self.row_order is None else self.row_order[order])

    def pad_rows(self, rows: int) -> GGUFWeight:
        """Zero rows appended up to ``rows``: a zero block is a zero weight in every type (its scales are 0)."""
        if rows == self.rows:
            return self
        padded = torch.zeros((rows, self.row_bytes), dtype=torch.uint8)
        padded[: self.rows] = self.data
        return GGUFWeight(self.ggml_type, padded, self.cols)


def dequantize_rows(data: torch.Tensor, ggml_type: GGMLQuantizationType, cols: int) -> torch.Tensor:
    """Float32 ``[rows, cols]`` of GGUF rows ``data`` (uint8 ``[rows, row_bytes]``)."""
    raw = data.numpy() if data.is_contiguous() else data.contiguous().numpy()
    values = dequantize(raw, ggml_type)
    values = np.ascontiguousarray(values, dtype=np.float32)
    if not values.flags.writeable:
        values = values.copy()
    return torch.from_numpy(values).reshape(data.shape[0], cols)
