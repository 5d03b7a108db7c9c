"""Micro-benchmark of the linear layers: BLAS (``F.linear``) against the packed small-batch kernel.

    python -m pagellm.bench.gemm_bench [--rows 1,8,16,32,64,128,256,1024] [--int8] [--bf16] [--save-result out.json]

Runs the four projections of every SmolLM2-135M layer (q/k/v, o, gate/up, down) with 30 layers'
worth of distinct weights, so that, as in the model, the weights stream from memory rather than
sitting in cache. The weights are random but of the shipped GGUF's form (4-bit blocks for the
layers, 8-bit for the vocabulary head, see ``kernels/csrc/quant_blocks.h``), so the packed kernel
runs on float32 panels and on block panels of the same values. For each batch size (rows) the
paths run in turns; the table shows the fastest pass over all layers for each, the packed paths'
speed-up over BLAS and GFLOP/s. The vocabulary head (576 -> 49,152) is timed separately.
``--int8`` adds the int8 dot-product kernel on the same blocks (``ops.linear_int8``, x quantized
per 32 inputs, so not the same results) and its speed-up over the float32 and the block panels;
``--bf16`` the bfloat16 dot-product kernel (``ops.linear_bf16``, weights and x rounded to bfloat16)
and its speed-up over the float32 panels.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

import torch
from torch.nn import functional as F

from pagellm.kernels import ops
from pagellm.kernels.tuning import SMOLLM2_LAYER_SHAPES, block_quantized

# (in, out) of SmolLM2-135M's fused projections, and its depth and vocabulary head.
LAYER_SHAPES = list(SMOLLM2_LAYER_SHAPES)
NUM_LAYERS = 30
VOCAB_SHAPE = (576, 49152)


@dataclass
class GemmRow:
    case: str
    rows: int
    blas_ms: float
    packed_ms: float  # float32 panels
    blocks_ms: float  # block panels (4- or 8-bit), same values
    speedup: float  # BLAS / float32 panels
    blocks_speedup: float  # BLAS / block panels
    packed_gflops: float
    blocks_gflops: float
    int8_ms: Optional[float] = None  # int8 dot products on the same blocks (--int8)
    int8_vs_packed: Optional[float] = None  # float32 panels / int8
    int8_vs_blocks: Optional[float] = None  # block panels / int8
    bf16_ms: Optional[float] = None  # bfloat16 panels of the same weights (--bf16)
    bf16_vs_packed: Optional[float] = None  # float32 panels / bfloat16


def _best_of(fn: Callable[[], None], reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _compare(
    case: str, shapes: list[tuple[int, int]], weights: list[torch.Tensor], rows: int, reps: int, int8: bool, bf16: bool
) -> GemmRow:
    packed = [ops.pack_weight(w) for w in weights]
    blocks = [ops.pack_weight_blocks(w) for w in weights]
    int8_blocks = [ops.pack_weight_int8(w) for w in weights] if int8 else []
    bf16_panels = [ops.pack_weight_bf16(w) for w in weights] if bf16 else []
    if any(b is None for b in blocks + int8_blocks):
        raise RuntimeError("the block-form weights were not packed as blocks")
    inputs = [torch.randn(rows, shapes[i % len(shapes)][0]) for i in range(len(shapes))]
    outputs = [torch.empty(rows, w.shape[0]) for w in weights]

    def blas() -> None:
        for i, w in enumerate(weights):
            F.linear(inputs[i % len(inputs)], w)

    def run_packed(panels: list[torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for i, p in enumerate(panels):
                ops.linear_packed(outputs[i], inputs[i % len(inputs)], p, None)

        return run

    def run_int8() -> None:
        for i, p in enumerate(int8_blocks):
            ops.linear_int8(outputs[i], inputs[i % len(inputs)], p, None)

    def run_bf16() -> None:
        for i, p in enumerate(bf16_panels):
            ops.linear_bf16(outputs[i], inputs[i % len(inputs)], p, None)

    blas_s = packed_s = blocks_s = int8_s = bf16_s = float("inf")
    for _ in range(2):  # alternate, so drift on a shared machine hits all of them
        blas_s = min(blas_s, _best_of(blas, reps))
        packed_s = min(packed_s, _best_of(run_packed(packed), reps))
        blocks_s = min(blocks_s, _best_of(run_packed(blocks), reps))
        if int8:
            int8_s = min(int8_s, _best_of(run_int8, reps))
        if bf16:
            bf16_s = min(bf16_s, _best_of(run_bf16, reps))
    flops = 2 * rows * sum(w.numel() for w in weights)
    row = GemmRow(case, rows, blas_s * 1e3, packed_s * 1e3, blocks_s * 1e3, blas_s / packed_s, blas_s / blocks_s,
                  flops / packed_s / 1e9, flops / blocks_s / 1e9)
    if int8:
        row.int8_ms, row.int8_vs_packed, row.int8_vs_blocks = int8_s * 1e3, packed_s / int8_s, blocks_s / int8_s
    if bf16:
        row.bf16_ms, row.bf16_vs_packed = bf16_s * 1e3, packed_s / bf16_s
    return row


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
        print("this build has no int8 dot products (AVX512-VNNI or AVX-VNNI); nothing to compare")
        return 1
    if args.bf16 and not ops.bf16_matmul_available():
        print("this build has no bfloat16 dot products (AVX512_BF16); nothing to compare")
        return 1
    generator = torch.Generator().manual_seed(0)
    layer_weights = [block_quantized(n, k, 4, generator) for _ in range(NUM_LAYERS) for k, n in LAYER_SHAPES]
    vocab_weight = [block_quantized(VOCAB_SHAPE[1], VOCAB_SHAPE[0], 8, generator)]
    results = []
    int8_head = f"{'int8 blocks':>25}" if args.int8 else ""
    int8_cols = f"{'ms':>9}{'/float32':>9}{'/blocks':>8}" if args.int8 else ""
    bf16_head = f"{'bf16 panels':>17}" if args.bf16 else ""
    bf16_cols = f"{'ms':>8}{'/float32':>9}" if args.bf16 else ""
    print(f"{'':<18}{'BLAS':>8}{'float32 panels':>25}{'block panels':>25}{int8_head}{bf16_head}")
    print(f"{'case':<12}{'rows':>6}{'ms':>8}{'ms':>9}{'speed-up':>9}{'GFLOP/s':>8}{'ms':>9}{'speed-up':>9}{'GFLOP/s':>8}"
          f"{int8_cols}{bf16_cols}")
    for rows in [int(r) for r in args.rows.split(",")]:
        for case, shapes, weights in (("30 layers", LAYER_SHAPES, layer_weights), ("vocab head", [VOCAB_SHAPE], vocab_weight)):
            row = _compare(case, shapes, weights, rows, args.reps, args.int8, args.bf16)
            results.append(row)
            int8 = f"{row.int8_ms:>9.1f}{row.int8_vs_packed:>8.2f}x{row.int8_vs_blocks:>7.2f}x" if args.int8 else ""
            bf16 = f"{row.bf16_ms:>8.1f}{row.bf16_vs_packed:>8.2f}x" if args.bf16 else ""
            print(f"{row.case:<12}{row.rows:>6}{row.blas_ms:>8.1f}{row.packed_ms:>9.1f}{row.speedup:>8.2f}x"
                  f"{row.packed_gflops:>8.0f}{row.blocks_ms:>9.1f}{row.blocks_speedup:>8.2f}x{row.blocks_gflops:>8.0f}{int8}{bf16}")
    if args.save_result:
        with open(args.save_result, "w", encoding="utf-8") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                       "rows": [asdict(r) for r in results]}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
