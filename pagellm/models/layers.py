"""The elementwise layers of a Llama block: RMSNorm, SiLU-and-multiply, rotary embedding.

Each has two paths with the same arithmetic: the fused C++ kernel (``torch.ops.pagellm_ops``)
for float32 tensors on CPU, and plain torch for everything else (other devices and dtypes, or
when the kernels could not be built). In eager torch these layers are a dozen small ops per
block, each a dispatch, an allocation and a pass over memory: at a decode batch of 32 they cost
about as much as attention, at a 1,024-token prefill step a sixth of the step.
"""
from __future__ import annotations

from typing import Optional, overload

import torch
from torch import nn

from pagellm.kernels.build import load_kernels


def use_cpu_kernels(x: torch.Tensor) -> bool:
    """Whether ``x`` goes through the fused C++ kernels (float32 on CPU, and the kernels built)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and load_kernels()


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
        fused = use_cpu_kernels(x) and x.dim() == 2 and x.stride(-1) == 1
        if residual is None:
            if fused:
                out = torch.empty_like(x, memory_format=torch.contiguous_format)
                torch.ops.pagellm_ops.rms_norm(out, x, self.weight, self.eps)
                return out
            return self._reference(x)
        if fused and residual.stride(-1) == 1 and residual.shape == x.shape:
            torch.ops.pagellm_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        residual = residual.add_(x)
        return self._reference(residual), residual

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 as transformers does, so half-precision models do not lose range.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]`` for the fused gate/up projection output ``[T, 2d]``."""
    d = x.shape[-1] // 2
    if use_cpu_kernels(x) and x.dim() == 2 and x.stride(-1) == 1:
        out = torch.empty((x.shape[0], d), dtype=x.dtype, device=x.device)
        torch.ops.pagellm_ops.silu_and_mul(out, x)
        return out
    return nn.functional.silu(x[..., :d]).mul_(x[..., d:])


def rotate_in_place(
    qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, head_dim: int
) -> bool:
    """Rotates the first ``num_heads`` heads of each row of ``qkv`` in place; False if this
    tensor needs the torch path (:func:`apply_rotary`) instead.

    ``cos``/``sin`` are whole tables ``[max_positions, head_dim // 2]``, gathered by position
    inside the kernel.
    """
    if not (use_cpu_kernels(qkv) and qkv.dim() == 2 and qkv.stride(-1) == 1):
        return False
    torch.ops.pagellm_ops.rotary_embedding(qkv, positions, cos, sin, num_heads, head_dim)
    return True
