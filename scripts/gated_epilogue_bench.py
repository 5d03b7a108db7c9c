"""Fused gated activations (GELU-tanh, gpt-oss's clamped SwiGLU) in the int8 and bf16 gate/up
kernels' epilogue, against the plain product followed by torch's activation, in turns.

    PYTHONPATH=. .venv/bin/python scripts/gated_epilogue_bench.py
"""
from __future__ import annotations

import time
from typing import Callable

import torch
from gguf import GGMLQuantizationType as T

from pagellm.kernels import ops
from pagellm.layers.linear_method import BF16Method, GGUFInt8Method, LinearMethod
from tests.gguf_blocks import random_gguf_weight

HIDDEN, INTER = 2048, 8192  # a 1.7B-size MLP


def ms_per_call(fn: Callable[[], object], repeats: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def compare(fused: LinearMethod, plain: LinearMethod, x: torch.Tensor, activation: str, repeats: int) -> str:
    t_fused = ms_per_call(lambda: fused.apply_gated(x, None, activation), repeats)
    t_plain = ms_per_call(lambda: ops.gated_and_mul_torch(plain.apply(x, None), activation), repeats)
    return f"fused {t_fused:.3f} ms / product+torch {t_plain:.3f} ms = {t_plain / t_fused:.2f}x"


def main() -> None:
    if not ops.available():
        raise SystemExit("the CPU kernels are not built")
    torch.manual_seed(0)
    gate, up = random_gguf_weight(T.Q4_K, INTER, HIDDEN, 1), random_gguf_weight(T.Q4_K, INTER, HIDDEN, 2)
    dense = torch.cat([gate.dequantize(), up.dequantize()]).bfloat16()
    pairs = {
        "int8": (GGUFInt8Method([gate, up], gate_up=True), GGUFInt8Method([gate, up], gate_up=False)),
        "bf16": (BF16Method(dense, True), BF16Method(dense, False)),
    }
    for activation in ("gelu_pytorch_tanh", "swiglu_oai"):
        for rows in (1, 16, 256):
            x = torch.randn(rows, HIDDEN)
            repeats = 200 if rows < 100 else 20
            cells = [f"{name} {compare(f, p, x, activation, repeats)}" for name, (f, p) in pairs.items() for _ in range(2)]
            print(activation, rows, " | ".join(cells))


if __name__ == "__main__":
    main()
