"""Micro-benchmark of the linear layers: BLAS (``F.linear``) against the packed small-batch kernel.

    python -m pagellm.bench.gemm_bench [--rows 1,8,16,32,64,128,256,1024] [--int8] [--bf16] [--save-result out.json]

Runs the four projections of every SmolLM2-135M layer (q/k/v, o, gate/up, down) with 30 layers'
worth of distinct weights, so that, as in the model, the weights stream from memory rather than
sitting in cache. The weights are random but of the shipped GGUF's form dequantized to float32
(4-bit blocks for the layers, 8-bit for the vocabulary head), and the packed kernel runs on their
float32 panels. For each batch size (rows) the paths run in turns; the table shows the fastest
pass over all layers for each, the panels' speed-up over BLAS and GFLOP/s. The vocabulary head
(576 -> 49,152) is timed separately. ``--bf16`` adds the bfloat16 dot-product kernel
(``ops.linear_bf16``, weights and x rounded to bfloat16) and its speed-up over the float32 panels.
``--int8`` adds a table of the int8 dot-product kernel (``ops.linear_int8``, x quantized per 32
inputs) on raw GGUF blocks of the types a Q4_K_M file holds (Q4_K, Q6_K), in SmolLM2-1.7B's MLP
shapes (2048 -> 8192, 8192 -> 2048), with enough distinct weights that they stream from memory:
ms, GB/s of packed weight bytes (what bounds a decode step) and GOP/s.
"""
from __future__ import annotations

import argparse
import functools
import json
import platform
from dataclasses import asdict, dataclass
from typing import Optional

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch.nn import functional as F

from pagellm.bench.common import best_of
from pagellm.kernels import ops
from pagellm.kernels.tuning import SMOLLM2_LAYER_SHAPES

# (in, out) of SmolLM2-135M's fused projections, and its depth and vocabulary head.
LAYER_SHAPES = list(SMOLLM2_LAYER_SHAPES)
NUM_LAYERS = 30
VOCAB_SHAPE = (576, 49152)
# --int8: (in, out) of SmolLM2-1.7B's up (or gate) and down projections, the types of a Q4_K_M
# file, the byte offsets of their fp16 scales in a block, and distinct weights of this many bytes.
INT8_SHAPES = ((2048, 8192), (8192, 2048))
INT8_SCALE_FIELDS = {"Q4_K": (0, 2), "Q6_K": (208,)}
INT8_STREAM_BYTES = 192 << 20


def block_quantized(rows: int, cols: int, bits: int, generator: torch.Generator) -> torch.Tensor:
    """Random float32 ``[rows, cols]`` as a dequantized GGUF model holds: every 32 inputs 4-bit
    ``d * q + m`` (Q4_1) or 8-bit ``d * q`` (Q8_0), half-precision ``d`` and ``m``."""
    blocks = (rows, cols // 32, 1)
    d = (torch.rand(blocks, generator=generator) * 0.004 + 0.001).half().float()
    if bits == 4:
        q = torch.randint(0, 16, (rows, cols // 32, 32), generator=generator).float()
        m = (-8 * d - torch.rand(blocks, generator=generator) * 0.001).half().float()
        return (d * q + m).reshape(rows, cols)
    q = torch.randint(-127, 128, (rows, cols // 32, 32), generator=generator).float()
    return (d * q).reshape(rows, cols)


@dataclass
class GemmRow:
    case: str
    rows: int
    blas_ms: float
    packed_ms: float  # float32 panels
    speedup: float  # BLAS / float32 panels
    packed_gflops: float
    bf16_ms: Optional[float] = None  # bfloat16 panels of the same weights (--bf16)
    bf16_vs_packed: Optional[float] = None  # float32 panels / bfloat16


@dataclass
class Int8Row:
    ggml_type: str
    in_features: int
    out_features: int
    rows: int
    ms: float
    packed_gb_s: float  # packed weight bytes read per second
    gops: float


def _compare(
    case: str, shapes: list[tuple[int, int]], weights: list[torch.Tensor], rows: int, reps: int, bf16: bool
) -> GemmRow:
    packed = [ops.pack_weight(w) for w in weights]
    bf16_panels = [ops.pack_weight_bf16(w) for w in weights] if bf16 else []
    inputs = [torch.randn(rows, shapes[i % len(shapes)][0]) for i in range(len(shapes))]
    outputs = [torch.empty(rows, w.shape[0]) for w in weights]

    def blas() -> None:
        for i, w in enumerate(weights):
            F.linear(inputs[i % len(inputs)], w)

    def run_packed() -> None:
        for i, p in enumerate(packed):
            ops.linear_packed(outputs[i], inputs[i % len(inputs)], p, None)

    def run_bf16() -> None:
        for i, p in enumerate(bf16_panels):
            ops.linear_bf16(outputs[i], inputs[i % len(inputs)], p, None)

    blas_s = packed_s = bf16_s = float("inf")
    for _ in range(2):  # alternate, so drift on a shared machine hits all of them
        blas_s = min(blas_s, best_of(blas, reps))
        packed_s = min(packed_s, best_of(run_packed, reps))
        if bf16:
            bf16_s = min(bf16_s, best_of(run_bf16, reps))
    flops = 2 * rows * sum(w.numel() for w in weights)
    row = GemmRow(case, rows, blas_s * 1e3, packed_s * 1e3, blas_s / packed_s, flops / packed_s / 1e9)
    if bf16:
        row.bf16_ms, row.bf16_vs_packed = bf16_s * 1e3, packed_s / bf16_s
    return row


def _random_blocks(ggml_type: str, rows: int, cols: int, generator: torch.Generator) -> torch.Tensor:
    """uint8 ``[rows, row bytes]`` of valid GGUF blocks: random quants and sub-scales, fp16 scales of 0.001..0.005."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    raw = torch.randint(0, 256, (rows, cols // block, size), dtype=torch.uint8, generator=generator)
    for at in INT8_SCALE_FIELDS[ggml_type]:
        scale = torch.rand(rows, cols // block, 1, generator=generator) * 0.004 + 0.001
        raw[..., at : at + 2] = scale.half().view(torch.uint8)
    return raw.reshape(rows, -1)


def _run_int8(out: torch.Tensor, x: torch.Tensor, copies: list[torch.Tensor], ggml_type: int) -> None:
    for packed in copies:
        ops.linear_int8(out, x, packed, ggml_type, None)


def _int8_rows(rows_list: list[int], reps: int) -> list[Int8Row]:
    generator = torch.Generator().manual_seed(0)
    results = []
    for name in INT8_SCALE_FIELDS:
        ggml_type = int(GGMLQuantizationType[name])
        for k, n in INT8_SHAPES:
            packed = ops.pack_weight_int8(_random_blocks(name, n, k, generator), ggml_type, k)
            copies = [packed] + [packed.clone() for _ in range(INT8_STREAM_BYTES // packed.numel() - 1)]
            for rows in rows_list:
                x, out = torch.randn(rows, k, generator=generator), torch.empty(rows, n)
                run = functools.partial(_run_int8, out, x, copies, ggml_type)
                s = min(best_of(run, reps) for _ in range(2)) / len(copies)
                row = Int8Row(name, k, n, rows, s * 1e3, packed.numel() / s / 1e9, 2 * rows * n * k / s / 1e9)
                results.append(row)
                print(f"{name:<6}{k:>6} -> {n:<6}{rows:>6}{row.ms:>9.3f}{row.packed_gb_s:>8.1f}{row.gops:>8.0f}")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,16,32,64,128,256,1024")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--int8", action="store_true", help="also time the int8 dot-product kernel (ops.linear_int8)")
    parser.add_argument("--bf16", action="store_true", help="also time the bfloat16 dot-product kernel (ops.linear_bf16)")
    parser.add_argument("--save-result", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if not ops.available():
        print("the C++ kernels are unavailable; nothing to compare")
        return 1
    if args.int8 and not ops.int8_matmul_available():
        print("this build has no int8 dot products (AVX2 or AVX512-BW); nothing to compare")
        return 1
    if args.bf16 and not ops.bf16_matmul_available():
        print("this build has no bfloat16 dot products (AVX512_BF16); nothing to compare")
        return 1
    generator = torch.Generator().manual_seed(0)
    layer_weights = [block_quantized(n, k, 4, generator) for _ in range(NUM_LAYERS) for k, n in LAYER_SHAPES]
    vocab_weight = [block_quantized(VOCAB_SHAPE[1], VOCAB_SHAPE[0], 8, generator)]
    results = []
    bf16_head = f"{'bf16 panels':>17}" if args.bf16 else ""
    bf16_cols = f"{'ms':>8}{'/float32':>9}" if args.bf16 else ""
    print(f"{'':<18}{'BLAS':>8}{'float32 panels':>25}{bf16_head}")
    print(f"{'case':<12}{'rows':>6}{'ms':>8}{'ms':>9}{'speed-up':>9}{'GFLOP/s':>8}{bf16_cols}")
    for rows in [int(r) for r in args.rows.split(",")]:
        for case, shapes, weights in (("30 layers", LAYER_SHAPES, layer_weights), ("vocab head", [VOCAB_SHAPE], vocab_weight)):
            row = _compare(case, shapes, weights, rows, args.reps, args.bf16)
            results.append(row)
            bf16 = f"{row.bf16_ms:>8.1f}{row.bf16_vs_packed:>8.2f}x" if args.bf16 else ""
            print(f"{row.case:<12}{row.rows:>6}{row.blas_ms:>8.1f}{row.packed_ms:>9.1f}{row.speedup:>8.2f}x"
                  f"{row.packed_gflops:>8.0f}{bf16}")
    int8_results = []
    if args.int8:
        print(f"\nint8 kernel on GGUF blocks, {INT8_STREAM_BYTES >> 20} MiB of distinct weights per shape")
        print(f"{'type':<6}{'in -> out':^16}{'rows':>6}{'ms':>9}{'GB/s':>8}{'GOP/s':>8}")
        int8_results = _int8_rows([int(r) for r in args.rows.split(",")], args.reps)
    if args.save_result:
        with open(args.save_result, "w", encoding="utf-8") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                       "rows": [asdict(r) for r in results], "int8": [asdict(r) for r in int8_results]}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
