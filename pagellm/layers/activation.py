"""Gated activations for a fused gate/up projection's output ``[T, 2d]`` (gate columns first).

SiLU goes through the C++ kernel (and is fused into the gate/up product where the weights are
packed for it); the others are a few torch ops after the product, in the arithmetic transformers
uses for the same ``hidden_act``.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.nn import functional as F

from pagellm.kernels import ops


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]``."""
    return ops.silu_and_mul(x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (Gemma's ``gelu_pytorch_tanh``)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate) * up


# gpt-oss's clamped SwiGLU constants (its config's swiglu_alpha and swiglu_limit).
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


def swiglu_oai_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gpt-oss: ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, l)``."""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
    up = up.clamp(min=-SWIGLU_OAI_LIMIT, max=SWIGLU_OAI_LIMIT)
    return (up + 1) * (gate * torch.sigmoid(gate * SWIGLU_OAI_ALPHA))


# transformers' hidden_act names -> the gated form.
_GATED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu_and_mul,
    "swish": silu_and_mul,
    "gelu_pytorch_tanh": gelu_tanh_and_mul,
    "gelu_tanh": gelu_tanh_and_mul,
    "gelu": gelu_and_mul,
    "swiglu_oai": swiglu_oai_and_mul,
}


def canonical_activation(hidden_act: str) -> str:
    """The name the layers use for a config's ``hidden_act``; ValueError for unsupported ones."""
    if hidden_act not in _GATED:
        raise ValueError(f"hidden_act {hidden_act!r} is not supported; supported: {', '.join(sorted(_GATED))}")
    return {"swish": "silu", "gelu_tanh": "gelu_pytorch_tanh"}.get(hidden_act, hidden_act)


def gated_activation(hidden_act: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return _GATED[canonical_activation(hidden_act)]
