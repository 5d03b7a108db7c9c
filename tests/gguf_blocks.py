"""Random but valid GGUF blocks of every quantized type, without llama.cpp.

Quants and sub-scales are random; the fp16 scale fields are set so that weights are of a real
model's size. ``gguf.quants.dequantize`` of the result is the reference weight.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from pagellm.layers.gguf_types import GGUFWeight

if TYPE_CHECKING:
    from pagellm.layers.moe import FusedMoE

T = GGMLQuantizationType

# Byte offsets, in a block, of the fp16 scale d (first) and of dmin where the type has one.
SCALE_FIELDS = {
    T.Q4_0: (0,), T.Q4_1: (0,), T.Q5_0: (0,), T.Q5_1: (0,), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
}
# The legacy types' fp16 offset m, added (w = d q + m): a block's minimum, so mostly negative.
OFFSET_FIELDS = {T.Q4_1: 2, T.Q5_1: 2}

def _half_field(rng: np.random.Generator, shape: tuple[int, ...], lo: float, hi: float) -> np.ndarray:
    return rng.uniform(lo, hi, size=shape).astype(np.float16).view(np.uint8).reshape(*shape[:-1], -1)


def random_blocks(qtype: T, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, row bytes] of valid blocks: random quants and sub-scales, fp16 scales of
    +-0.001..0.01 (dmin positive, legacy offsets -0.1..0.02), so the weights are of sane size."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    for i, at in enumerate(SCALE_FIELDS[qtype]):
        field = _half_field(rng, (rows, cols // block, 1), 0.001, 0.01)
        if i == 0:  # d: Q4_0 and Q5_0 scales are negative as often as not
            field = np.where(rng.random((rows, cols // block, 1)) < 0.5, field, field ^ np.array([0, 0x80], np.uint8))
        raw[..., at : at + 2] = field
    if qtype in OFFSET_FIELDS:
        at = OFFSET_FIELDS[qtype]
        raw[..., at : at + 2] = _half_field(rng, (rows, cols // block, 1), -0.1, 0.02)
    return raw.reshape(rows, -1)


def random_gguf_weight(qtype: T, rows: int, cols: int, seed: int = 0) -> GGUFWeight:
    """:func:`random_blocks` as a weight held in its blocks."""
    return GGUFWeight(qtype, torch.from_numpy(random_blocks(qtype, rows, cols, seed)), cols)


def random_moe_layer(
    gate_up_type: T, down_type: T, hidden: int, inter: int, num_experts: int, top_k: int, router: torch.Tensor
) -> "FusedMoE":
    """A mixture-of-experts layer of random blocks (expert e's gate, up and down drawn with seeds
    3e, 3e + 1, 3e + 2) on the int8 path, routed by ``router`` ``[experts, hidden]``."""
    from pagellm.config import LinearPrecision
    from pagellm.layers.moe import FusedMoE

    moe = FusedMoE(hidden, num_experts, top_k, inter)
    from pagellm.kernels import ops

    precision = LinearPrecision("int8", "bfloat16" if ops.bf16_matmul_available() else "float32")
    moe.gate.load_shard(None, router)
    moe.gate.process_weights_after_loading(precision)
    for e, expert in enumerate(moe.experts):
        expert.gate_up_proj.load_shard("gate", random_gguf_weight(gate_up_type, inter, hidden, seed=3 * e))
        expert.gate_up_proj.load_shard("up", random_gguf_weight(gate_up_type, inter, hidden, seed=3 * e + 1))
        expert.gate_up_proj.process_weights_after_loading(precision)
        expert.down_proj.load_shard(None, random_gguf_weight(down_type, hidden, inter, seed=3 * e + 2))
        expert.down_proj.process_weights_after_loading(precision)
    return moe
