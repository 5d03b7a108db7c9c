"""How a linear layer holds its weight and multiplies by it: one method per layer, chosen from the
checkpoint's own tensors (vLLM's ``LinearMethodBase``: the layer loads its shards as stored, then
:func:`create_linear_method` processes them once into the method's form, which ``apply`` uses).

- :class:`DenseMethod`: the weight in the model's dtype; on a CPU in float32 also as panels for the
  small-batch kernel (``ops.linear_packed``), BLAS for large batches. The exact path.
- :class:`BF16Method`: bfloat16 panels for ``vdpbf16ps`` (AVX512_BF16), packed straight from a
  bfloat16 checkpoint's values; no float32 copy is kept.
- :class:`GGUFInt8Method`: a GGUF weight's blocks repacked for the int8 dot-product kernel
  (``ops.linear_int8``), whatever its type (Q4_0 ... Q6_K); the file's blocks are not kept.
- :class:`SegmentedMethod`: a fused projection whose parts differ (Q4_K_M stores ``attn_v`` as
  Q6_K beside Q4_K ``attn_q``/``attn_k``): each part's method writes its own output columns.

Sources that no fast form takes (an IQ type, a weight whose width cuts its blocks) are dequantized
with gguf's own dequantizer, so every path computes from the values transformers would load.
"""
from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, Optional

import torch
from torch.nn import functional as F

from pagellm.config import LinearPrecision
from pagellm.kernels import ops
from pagellm.kernels.context import KernelContext
from pagellm.kernels.tuning import F32_PANELS, PackedForms, TuningKey
from pagellm.layers.gguf_types import GGUFWeight, kernel_takes

logger = logging.getLogger(__name__)

WeightSource = GGUFWeight | torch.Tensor

# Up to this many rows float32 panels beat BLAS on the machines measured; beyond it BLAS's
# blocking wins. The default until the load's KernelContext holds this machine's own crossover.
PACKED_MAX_ROWS = 96
# The kernels' fused gated activations pair gate and up columns in groups of one vector (AVX-512).
GATE_UP_GROUP = 16


def _rows_ok(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.stride(-1) == 1 and ops.supports(x)


def _context(kernels: Optional[KernelContext]) -> KernelContext:
    """The load's context, or for a method made outside a load one of its own (packs just run)."""
    return kernels if kernels is not None else KernelContext()


class LinearMethod(ABC):
    """A weight ``[out_features, in_features]`` in one form, and its product with ``x``."""

    out_features: int
    # Whether ``apply_gated`` fuses the activation into the product (a gate/up weight packed so).
    fused_gate_up: bool = False

    @abstractmethod
    def apply(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """``x @ W.T + bias``."""

    def apply_gated(self, x: torch.Tensor, bias: Optional[torch.Tensor], activation: str) -> torch.Tensor:
        """``act(x @ gate.T + b_g) * (x @ up.T + b_u)`` for a gate/up weight (gate rows first), the
        activation one of ``ops.FUSED_ACTIVATIONS``."""
        return ops.gated_and_mul(self.apply(x, bias), activation)

    def apply_gate_up(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """``x @ W.T + bias`` of a gate/up weight, gate columns first, whatever its packing: for a
        LoRA delta, which must reach gate and up before the activation."""
        return self.apply(x, bias)

    @abstractmethod
    def resident_tensors(self) -> list[torch.Tensor]:
        """The tensors this form keeps resident (one may be another holder's too: a tied head's
        table is the embedding's)."""

    @property
    def nbytes(self) -> int:
        """Bytes this form keeps resident."""
        return sum(t.nbytes for t in self.resident_tensors())

    @property
    @abstractmethod
    def form(self) -> str:
        """A short name of the stored form, for logs and the memory plan."""

    def rows_as_bf16_panels(self) -> Optional[torch.Tensor]:
        """The weight as ``ops.pack_weight_bf16`` panels packed unfused, from which its rows read
        back (a tied embedding then reads its rows there rather than keep the table twice); None
        for a form that holds none."""
        return None

    def tuning_probe(self, key: TuningKey) -> Optional[tuple[torch.Tensor, PackedForms]]:
        """``(weight, packed)`` on which the start-up measurement of ``key`` (pagellm.kernels.tuning)
        times this form's kernel against BLAS, where that measurement decides this form's kernel;
        else None."""
        return None


class DenseMethod(LinearMethod):
    """The weight as a dense tensor (float32 on a CPU: the exact path), plus float32 panels for
    small batches where the CPU kernels take it. ``kernels``: the load's context, which the
    panels are packed through and the panels' row limit is read from at each call."""

    def __init__(self, weight: torch.Tensor, gate_up: bool, kernels: Optional[KernelContext] = None) -> None:
        self.kernels = kernels = _context(kernels)
        self.weight = weight.contiguous()
        self.out_features = weight.shape[0]
        self.panels: Optional[torch.Tensor] = None
        if not ops.supports(self.weight):
            return
        shape = list(self.weight.shape)
        if gate_up:
            try:
                self.panels = kernels.pack("f32_gate_up", [shape], lambda: ops.pack_weight_gate_up(self.weight))
                self.fused_gate_up = True
                return
            except ValueError:  # half the rows is not a whole number of vectors: two steps then
                pass
        self.panels = kernels.pack("f32", [shape], lambda: ops.pack_weight(self.weight))

    @property
    def packed_max_rows(self) -> int:
        """Up to how many rows the panels are used, BLAS beyond: this machine's measured crossover
        once the loader has set it on the context, else PACKED_MAX_ROWS."""
        return self.kernels.packed_max_rows(F32_PANELS, PACKED_MAX_ROWS)

    def apply(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.panels is not None and not self.fused_gate_up and x.shape[0] <= self.packed_max_rows and _rows_ok(x):
            out = torch.empty((x.shape[0], self.out_features), dtype=x.dtype, device=x.device)
            ops.linear_packed(out, x, self.panels, bias)
            return out
        return F.linear(x, self.weight, bias)

    def apply_gated(self, x: torch.Tensor, bias: Optional[torch.Tensor], activation: str) -> torch.Tensor:
        if self.fused_gate_up and x.shape[0] <= self.packed_max_rows and _rows_ok(x):
            out = torch.empty((x.shape[0], self.out_features // 2), dtype=x.dtype, device=x.device)
            ops.linear_packed_gated(out, x, self.panels, bias, activation)
            return out
        return ops.gated_and_mul(F.linear(x, self.weight, bias), activation)

    def apply_gate_up(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        return F.linear(x, self.weight, bias) if self.fused_gate_up else self.apply(x, bias)

    def resident_tensors(self) -> list[torch.Tensor]:
        return [self.weight] if self.panels is None else [self.weight, self.panels]

    @property
    def form(self) -> str:
        dtype = str(self.weight.dtype).removeprefix("torch.")
        return f"{dtype} + panels" if self.panels is not None else dtype

    def tuning_probe(self, key: TuningKey) -> Optional[tuple[torch.Tensor, PackedForms]]:
        if key == F32_PANELS and self.panels is not None and not self.fused_gate_up:
            return self.weight, self  # type: ignore[return-value]  # panels is set
        return None


class _PanelsMethod(LinearMethod):
    """A weight packed once into a kernel's panels (``packed``), which take every batch size."""

    packed: torch.Tensor

    @abstractmethod
    def product_into(self, out: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor], activation: Optional[str]) -> None:
        """The kernel: ``out = x @ W.T + bias``, or ``act(gate) * up`` with a gated ``activation``."""

    def apply(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if self.fused_gate_up:
            raise ValueError("a gate/up weight packed for a fused activation goes through apply_gated")
        out = torch.empty((x.shape[0], self.out_features), dtype=x.dtype, device=x.device)
        self.product_into(out, x.contiguous(), bias, None)
        return out

    def apply_gated(self, x: torch.Tensor, bias: Optional[torch.Tensor], activation: str) -> torch.Tensor:
        if not self.fused_gate_up:
            return ops.gated_and_mul(self.apply(x, bias), activation)
        out = torch.empty((x.shape[0], self.out_features // 2), dtype=x.dtype, device=x.device)
        self.product_into(out, x.contiguous(), bias, activation)
        return out

    def apply_gate_up(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if not self.fused_gate_up:
            return self.apply(x, bias)
        # Panels packed for the fused activation hold gate and up rows alternately, one vector each.
        mixed = torch.empty((x.shape[0], self.out_features), dtype=x.dtype, device=x.device)
        self.product_into(mixed, x.contiguous(), None, None)
        groups = mixed.view(x.shape[0], -1, 2, GATE_UP_GROUP)
        out = torch.cat((groups[:, :, 0].reshape(x.shape[0], -1), groups[:, :, 1].reshape(x.shape[0], -1)), dim=1)
        return out if bias is None else out + bias

    def resident_tensors(self) -> list[torch.Tensor]:
        return [self.packed]


class BF16Method(_PanelsMethod):
    """bfloat16 panels, every batch size (they beat float32 BLAS even at a long prefill's rows)."""

    def __init__(self, weight: torch.Tensor, gate_up: bool, kernels: Optional[KernelContext] = None) -> None:
        kernels = _context(kernels)
        self.out_features = weight.shape[0]
        signature: list[Any] = [list(weight.shape), str(weight.dtype)]
        if gate_up:
            try:
                self.packed = kernels.pack("bf16", signature + [True], lambda: ops.pack_weight_bf16(weight, True))
                self.fused_gate_up = True
                return
            except ValueError:
                pass
        self.packed = kernels.pack("bf16", signature + [False], lambda: ops.pack_weight_bf16(weight, False))

    def product_into(self, out: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor], activation: Optional[str]) -> None:
        ops.linear_bf16(out, x, self.packed, bias, activation)

    @property
    def form(self) -> str:
        return "bf16 panels"

    def rows_as_bf16_panels(self) -> Optional[torch.Tensor]:
        return None if self.fused_gate_up else self.packed


class GGUFInt8Method(_PanelsMethod):
    """One GGUF type's blocks, repacked once for the int8 kernel, straight from the parts' rows as
    stored (the shards of a fused projection are read in place, not concatenated); with
    ``gate_up`` the gate and up rows are taken alternately (in groups of one vector) so the
    kernel stores act(gate) * up."""

    def __init__(
        self, weight: GGUFWeight | list[GGUFWeight], gate_up: bool = False, kernels: Optional[KernelContext] = None
    ) -> None:
        parts = [weight] if isinstance(weight, GGUFWeight) else weight
        first = parts[0]
        if any(p.ggml_type != first.ggml_type or p.cols != first.cols for p in parts):
            raise ValueError("only weights of one GGUF type and width pack as one")
        self.ggml_type = first.ggml_type
        self.out_features = sum(p.rows for p in parts)
        self.in_features = first.cols
        interleave = 0
        if gate_up and self.out_features % (2 * GATE_UP_GROUP) == 0:
            interleave = GATE_UP_GROUP
            self.fused_gate_up = True
        signature = [int(self.ggml_type), self.in_features, interleave, [[p.rows, p.row_bytes] for p in parts]]

        def pack() -> torch.Tensor:  # the parts' rows are read (a permutation copied) only here
            datas = [p.data if p.data.stride(-1) == 1 else p.data.contiguous() for p in parts]
            return ops.pack_weight_int8(datas, int(self.ggml_type), self.in_features, interleave)

        self.packed = _context(kernels).pack("int8", signature, pack)

    def product_into(self, out: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor], activation: Optional[str]) -> None:
        ops.linear_int8(out, x, self.packed, int(self.ggml_type), bias, activation)

    @property
    def form(self) -> str:
        return f"{self.ggml_type.name} int8-kernel blocks"


class SegmentedMethod(LinearMethod):
    """Parts of a fused projection in different forms, each writing its own output columns."""

    def __init__(self, parts: list[LinearMethod]) -> None:
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)

    def apply(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        out = torch.empty((x.shape[0], self.out_features), dtype=x.dtype, device=x.device)
        x = x.contiguous()
        start = 0
        for part in self.parts:
            end = start + part.out_features
            part_bias = None if bias is None else bias[start:end]
            if isinstance(part, GGUFInt8Method):  # writes its columns in place
                part.product_into(out[:, start:end], x, part_bias, None)
            else:
                out[:, start:end] = part.apply(x, part_bias)
            start = end
        return out

    def resident_tensors(self) -> list[torch.Tensor]:
        return [t for part in self.parts for t in part.resident_tensors()]

    @property
    def form(self) -> str:
        return " | ".join(p.form for p in self.parts)


def _as_dense(source: WeightSource) -> torch.Tensor:
    return source.dequantize() if isinstance(source, GGUFWeight) else source


def _float_method(
    sources: list[WeightSource],
    precision: LinearPrecision,
    device: torch.device,
    dtype: torch.dtype,
    gate_up: bool,
    kernels: Optional[KernelContext],
) -> LinearMethod:
    if device.type == "cpu" and precision.fallback == "bfloat16":
        parts = [_as_dense(s) for s in sources]
        same = all(p.dtype == parts[0].dtype for p in parts)
        weight = parts[0] if len(parts) == 1 else torch.cat(parts if same else [p.float() for p in parts])
        if weight.dtype not in (torch.float32, torch.bfloat16):
            weight = weight.float()
        return BF16Method(weight, gate_up, kernels)
    parts = [_as_dense(s).to(device=device, dtype=dtype) for s in sources]
    # One part is used as it is: a tied head then shares the embedding's float table.
    return DenseMethod(parts[0] if len(parts) == 1 else torch.cat(parts), gate_up, kernels)


def create_linear_method(
    sources: list[WeightSource],
    precision: LinearPrecision,
    device: torch.device,
    dtype: torch.dtype,
    gate_up: bool = False,
    kernels: Optional[KernelContext] = None,
) -> LinearMethod:
    """The method for a layer whose weight is ``sources`` stacked by rows (the shards of a fused
    projection in order, or one tensor), as stored in the checkpoint; ``precision`` says what the
    linear layers compute in (pagellm.models.precision). ``gate_up``: a gate/up weight whose
    activation the kernel may apply in the product's epilogue (packed for it where it can).
    ``kernels``: the load's :class:`KernelContext`, which every pack goes through (None: one of
    the method's own)."""
    use_kernel = device.type == "cpu" and precision.kind == "int8"

    def kind(source: WeightSource) -> str:
        if use_kernel and isinstance(source, GGUFWeight) and kernel_takes(source.ggml_type):
            return source.ggml_type.name
        return "float"

    groups: list[tuple[str, list[WeightSource]]] = []
    for source in sources:
        k = kind(source)
        if groups and groups[-1][0] == k:
            groups[-1][1].append(source)
        else:
            groups.append((k, [source]))

    def build(k: str, group: list[WeightSource], fuse: bool) -> LinearMethod:
        if k == "float":
            return _float_method(group, precision, device, dtype, fuse, kernels)
        return GGUFInt8Method(group, fuse, kernels)  # type: ignore[arg-type]

    if len(groups) == 1:
        return build(*groups[0], gate_up)
    return SegmentedMethod([build(k, group, False) for k, group in groups])
