"""Gated activations for a fused gate/up projection's output ``[T, 2d]`` (gate columns first), and
the plain ones of MLPs without a gate (Nemotron-H's squared ReLU).

SiLU, GELU-tanh and gpt-oss's clamped SwiGLU go through the C++ kernels (and are fused into the
gate/up product's epilogue where the weights are packed for it: ``ops.FUSED_ACTIVATIONS``); exact
GELU is a few torch ops after the product, in the arithmetic transformers uses.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.nn import functional as F

from pagellm.kernels import ops


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[:, :d]) * x[:, d:]``."""
    return ops.gated_and_mul(x, "silu")


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` (Gemma's ``gelu_pytorch_tanh``)."""
    return ops.gated_and_mul(x, "gelu_pytorch_tanh")


def gelu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate) * up


def swiglu_oai_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gpt-oss: ``(clamp(up, -l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = min(gate, l)``."""
    return ops.gated_and_mul(x, "swiglu_oai")


# transformers' hidden_act names -> the gated form.
_GATED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": silu_and_mul,
    "swish": silu_and_mul,
    "gelu_pytorch_tanh": gelu_tanh_and_mul,
    "gelu_tanh": gelu_tanh_and_mul,
    "gelu": gelu_and_mul,
    "swiglu_oai": swiglu_oai_and_mul,
}


# Other names transformers' configs use for the same activations.
_ALIASES = {"swish": "silu", "gelu_tanh": "gelu_pytorch_tanh"}


def canonical_activation(hidden_act: str) -> str:
    """The name the layers use for a config's ``hidden_act``; ValueError for unsupported ones."""
    if hidden_act not in _GATED:
        raise ValueError(f"hidden_act {hidden_act!r} is not supported; supported: {', '.join(sorted(_GATED))}")
    return _ALIASES.get(hidden_act, hidden_act)


def gated_activation(hidden_act: str) -> Callable[[torch.Tensor], torch.Tensor]:
    return _GATED[canonical_activation(hidden_act)]


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """``relu(x) ** 2`` (transformers' ``relu2``, Nemotron-H's MLPs and experts)."""
    return torch.square(F.relu(x))


# transformers' hidden_act names -> the activation on its own, without a gate's product (an MLP
# without a gate: up, act, down; Gemma 4's per-layer input gate).
_PLAIN: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu2": relu_squared,
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def plain_activation(hidden_act: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation for a config's ``hidden_act`` applied on its own; ValueError for unsupported ones."""
    name = _ALIASES.get(hidden_act, hidden_act)
    if name not in _PLAIN:
        raise ValueError(f"activation {hidden_act!r} is not supported for an MLP without a gate; supported: {', '.join(sorted(_PLAIN))}")
    return _PLAIN[name]
