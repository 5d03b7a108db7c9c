"""The layers of a Llama block: linear projections, RMSNorm, SiLU-and-multiply, rotary embedding.

Each has two paths with the same arithmetic: a C++ kernel (:mod:`pagellm.kernels.ops`) for
float32 tensors on CPU, and plain torch for everything else (other devices and dtypes, or when
the kernels could not be built); ``ops`` decides which. In eager torch the elementwise layers are
a dozen small ops per block, each a dispatch, an allocation and a pass over memory, which at
decode batch sizes costs about as much as attention. Linear layers keep BLAS for large batches
and use pre-packed weights for small ones.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, overload

import torch
from torch import nn
from torch.nn import functional as F

from pagellm.config import EXACT_LINEAR, LinearKind, LinearPrecision
from pagellm.kernels import ops
from pagellm.kernels.tuning import CpuTuning, weight_format

# Up to this many rows a packed-weight product beats BLAS on the machines measured; beyond it
# BLAS's blocking wins. The default until CpuTuning holds this machine's own crossover.
PACKED_MAX_ROWS = 96


@dataclass
class PackedWeight:
    """A weight ``[N, K]`` laid out for the CPU kernels: float32 panels (and GGUF blocks) for the
    exact small-batch kernel (``ops.linear_packed``), or one low-precision form for every batch."""

    panels: Optional[torch.Tensor]  # float32 panels; None when a low-precision form serves instead
    # The weight's own 4- or 8-bit GGUF blocks when it is exactly that (a GGUF model's projections):
    # 0.75 or 1.125 bytes a weight, expanded by the kernel to the same float32 values, so the
    # results are bit for bit the panels'. Faster up to `blocks_max_rows` rows.
    blocks: Optional[torch.Tensor]
    blocks_max_rows: int = 0
    packed_max_rows: int = PACKED_MAX_ROWS  # BLAS beyond
    # The panels of a gate/up projection, packed for linear_packed_silu_mul: each W gate columns
    # next to their W up columns. They serve only :func:`linear_silu_and_mul`; the blocks keep the
    # weight's own order.
    silu_and_mul: bool = False
    # bfloat16 panels ("bfloat16") or int8-dotted GGUF blocks ("int8"), from
    # pagellm.models.precision: they take batches of every size, since they beat float32 BLAS
    # even at a long prefill's rows (docs/kernels.md).
    lowp: Optional[torch.Tensor] = None
    lowp_kind: Optional[LinearKind] = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.panels, self.blocks, self.lowp) if t is not None)

    def use_cpu_tuning(self, tuning: CpuTuning) -> None:
        """Takes the row limits measured for this weight's format, if they were measured."""
        if self.panels is None:
            return
        limits = tuning.limits_for(weight_format(self.blocks))
        if limits is not None:
            self.blocks_max_rows = limits.blocks_max_rows
            self.packed_max_rows = limits.packed_max_rows


def pack_weight(weight: torch.Tensor, silu_and_mul: bool = False, precision: LinearPrecision = EXACT_LINEAR) -> Optional[PackedWeight]:
    """``weight`` ``[N, K]`` packed for the CPU kernels, or None where they do not apply (not
    float32 on CPU, or no kernels). ``precision`` picks the form (see pagellm.models.precision).
    With ``silu_and_mul`` (a gate/up projection) the form is one for the fused activation where its
    halves split into whole vectors."""
    if not ops.supports(weight):
        return None
    weight = weight.detach()
    if precision.kind == "int8":
        lowp = _pack_int8(weight, silu_and_mul)
        if lowp is not None:
            return lowp
    if precision.fallback == "bfloat16":
        return _pack_bf16(weight, silu_and_mul)
    blocks = ops.pack_weight_blocks(weight)
    # The kernel's own default until a CpuTuning gives this machine's limit.
    max_rows = ops.blocks_max_rows(blocks) if blocks is not None else 0
    if silu_and_mul:
        try:
            return PackedWeight(ops.pack_weight_silu_mul(weight), blocks, max_rows, silu_and_mul=True)
        except ValueError:  # half the rows is not a multiple of the vector width: separate steps then
            pass
    return PackedWeight(ops.pack_weight(weight), blocks, max_rows)


def _pack_int8(weight: torch.Tensor, silu_and_mul: bool) -> Optional[PackedWeight]:
    """The weight's GGUF blocks for the int8 kernel, or None when it is not exactly blocks."""
    if silu_and_mul:
        try:
            packed = ops.pack_weight_int8(weight, True)
            return None if packed is None else PackedWeight(None, None, silu_and_mul=True, lowp=packed, lowp_kind="int8")
        except ValueError:  # halves of a width the fused epilogue cannot split
            pass
    packed = ops.pack_weight_int8(weight, False)
    return None if packed is None else PackedWeight(None, None, lowp=packed, lowp_kind="int8")


def _pack_bf16(weight: torch.Tensor, silu_and_mul: bool) -> PackedWeight:
    if silu_and_mul:
        try:
            return PackedWeight(None, None, silu_and_mul=True, lowp=ops.pack_weight_bf16(weight, True), lowp_kind="bfloat16")
        except ValueError:
            pass
    return PackedWeight(None, None, lowp=ops.pack_weight_bf16(weight, False), lowp_kind="bfloat16")


def _linear_lowp(x: torch.Tensor, packed: PackedWeight, bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    out = torch.empty((x.shape[0], out_features), dtype=x.dtype, device=x.device)
    if packed.lowp_kind == "int8":
        ops.linear_int8(out, x, packed.lowp, bias, packed.silu_and_mul)
    else:
        ops.linear_bf16(out, x, packed.lowp, bias, packed.silu_and_mul)
    return out


def _takes_lowp(x: torch.Tensor, packed: Optional[PackedWeight]) -> bool:
    return packed is not None and packed.lowp is not None and x.dim() == 2 and x.stride(-1) == 1 and ops.supports(x)


def _packed_operand(x: torch.Tensor, packed: Optional[PackedWeight]) -> Optional[torch.Tensor]:
    """What ``linear_packed`` multiplies ``x`` by: the blocks, the plain panels, or None for BLAS."""
    if packed is None or packed.panels is None or x.dim() != 2 or x.stride(-1) != 1 or not ops.supports(x):
        return None
    rows = x.shape[0]
    if packed.blocks is not None and rows <= packed.blocks_max_rows:
        return packed.blocks
    if rows <= packed.packed_max_rows and not packed.silu_and_mul:
        return packed.panels
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], packed: Optional[PackedWeight]) -> torch.Tensor:
    """``x @ weight.T + bias``; small batches go through ``packed`` (from :func:`pack_weight`) when given."""
    if _takes_lowp(x, packed):
        if packed.silu_and_mul:  # a fused form used through its plain product: not built so
            raise ValueError("a gate/up weight packed for the fused activation goes through linear_silu_and_mul")
        return _linear_lowp(x, packed, bias, weight.shape[0])
    operand = _packed_operand(x, packed)
    if operand is None:
        return F.linear(x, weight, bias)
    out = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
    ops.linear_packed(out, x, operand, bias)
    return out


def linear_silu_and_mul(
    x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], packed: Optional[PackedWeight]
) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` for a gate/up projection ``weight`` ``[2d, K]`` (gate rows
    first). Where the float32 panels would serve, one kernel does both and never writes the
    ``[T, 2d]`` product; elsewhere it is :func:`linear` then :func:`silu_and_mul`, same values."""
    rows = x.shape[0]
    if _takes_lowp(x, packed) and packed.silu_and_mul and bias is None:
        return _linear_lowp(x, packed, None, weight.shape[0] // 2)
    if (
        packed is not None
        and packed.lowp is None
        and packed.silu_and_mul
        and bias is None
        and x.dim() == 2
        and x.stride(-1) == 1
        and ops.supports(x)
        and not (packed.blocks is not None and rows <= packed.blocks_max_rows)  # the blocks' rows
        and rows <= packed.packed_max_rows
    ):
        out = torch.empty((rows, weight.shape[0] // 2), dtype=x.dtype, device=x.device)
        ops.linear_packed_silu_mul(out, x, packed.panels)
        return out
    return silu_and_mul(linear(x, weight, bias, packed))


class Linear(nn.Linear):
    """``nn.Linear`` that, after :meth:`pack`, runs small batches on a packed copy of its weight.

    The copy costs as much memory as the weight (a fifth more for a GGUF model's 4-bit blocks);
    large batches still use the original through BLAS.
    """

    packed: Optional[PackedWeight] = None

    def pack(self, precision: LinearPrecision = EXACT_LINEAR) -> int:
        """Packs the current weight (call again after changing it); returns the bytes added."""
        self.packed = pack_weight(self.weight, precision=precision)
        return 0 if self.packed is None else self.packed.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


class SiluAndMulLinear(Linear):
    """A gate/up projection (weight ``[2d, K]``, gate rows first) whose forward returns
    ``silu(gate) * up``, ``[T, d]``: the product and the activation in one pass where it can."""

    def pack(self, precision: LinearPrecision = EXACT_LINEAR) -> int:
        self.packed = pack_weight(self.weight, silu_and_mul=self.bias is None, precision=precision)
        return 0 if self.packed is None else self.packed.nbytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_silu_and_mul(x, self.weight, self.bias, self.packed)


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
