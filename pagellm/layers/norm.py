"""RMSNorm with the pre-norm residual add folded in (vLLM's), and Gemma's ``(1 + w)`` form."""
from __future__ import annotations

from typing import Optional, overload

import torch
from torch import nn

from pagellm.kernels import ops


class RMSNorm(nn.Module):
    """``norm(x)`` returns the normalised ``x``. ``norm(x, residual)`` first adds ``x`` to the
    residual stream and returns ``(normalised stream, stream)``; both inputs are overwritten (the
    caller owns them: they are the previous sublayer's fresh output and the running stream).

    ``weight_offset`` is added to the checkpoint's weight once, at load: Gemma stores ``w`` and
    multiplies by ``1 + w`` (in float32, as the kernel does with the sum).
    """

    def __init__(self, hidden_size: int, eps: float, weight_offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.weight_offset = weight_offset
        self.loaded = False

    def load_checkpoint_tensor(self, kind: str, shard: Optional[str], source: torch.Tensor) -> None:
        if kind != "weight" or shard:
            raise ValueError(f"a norm has no {kind}")
        if tuple(source.shape) != tuple(self.weight.shape):
            raise ValueError(f"norm weight has shape {tuple(source.shape)}, expected {tuple(self.weight.shape)}")
        self.weight.data.copy_(source)
        if self.weight_offset:
            self.weight.data.add_(self.weight_offset)
        self.loaded = True

    @overload
    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor: ...

    @overload
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalised stream, stream) for a stream of ``x + residual`` with the add still pending,
        or of ``x`` alone for a model's first layer (``residual`` None)."""
        if residual is None:
            return self(x), x
        return self(x, residual)

    def norm_heads(self, x: torch.Tensor) -> torch.Tensor:
        """Each head of ``x`` ``[T, heads, head_dim]`` normalised on its own (q/k norm): a new
        ``[T, heads * head_dim]`` tensor with contiguous rows."""
        tokens = x.shape[0]
        return ops.rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps).view(tokens, -1)
