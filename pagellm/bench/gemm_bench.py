"""Micro-benchmark of the linear layers: BLAS (``F.linear``) against the packed small-batch kernel.

    python -m pagellm.bench.gemm_bench [--rows 1,8,16,32,64,128,256,1024] [--save-result out.json]

Runs the four projections of every SmolLM2-135M layer (q/k/v, o, gate/up, down) with 30 layers'
worth of distinct weights, so that, as in the model, the weights stream from memory rather than
sitting in cache. The weights are random but of the shipped GGUF's form (4-bit blocks for the
layers, 8-bit for the vocabulary head, see ``kernels/csrc/quant_blocks.h``), so the packed kernel
runs on float32 panels and on block panels of the same values. For each batch size (rows) the
paths run in turns; the table shows the fastest pass over all layers for each, the packed paths'
speed-up over BLAS and GFLOP/s. The vocabulary head (576 -> 49,152) is timed separately.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, dataclass
from typing import Callable

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


def _best_of(fn: Callable[[], None], reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _compare(case: str, shapes: list[tuple[int, int]], weights: list[torch.Tensor], rows: int, reps: int) -> GemmRow:
    packed = [ops.pack_weight(w) for w in weights]
    blocks = [ops.pack_weight_blocks(w) for w in weights]
    if any(b is None for b in blocks):
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

    blas_s = packed_s = blocks_s = float("inf")
    for _ in range(2):  # alternate, so drift on a shared machine hits all three
        blas_s = min(blas_s, _best_of(blas, reps))
        packed_s = min(packed_s, _best_of(run_packed(packed), reps))
        blocks_s = min(blocks_s, _best_of(run_packed(blocks), reps))
    flops = 2 * rows * sum(w.numel() for w in weights)
    return GemmRow(case, rows, blas_s * 1e3, packed_s * 1e3, blocks_s * 1e3, blas_s / packed_s, blas_s / blocks_s,
                   flops / packed_s / 1e9, flops / blocks_s / 1e9)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,16,32,64,128,256,1024")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--save-result", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if not ops.available():
        print("the C++ kernels are unavailable; nothing to compare")
        return 1
    generator = torch.Generator().manual_seed(0)
    layer_weights = [block_quantized(n, k, 4, generator) for _ in range(NUM_LAYERS) for k, n in LAYER_SHAPES]
    vocab_weight = [block_quantized(VOCAB_SHAPE[1], VOCAB_SHAPE[0], 8, generator)]
    results = []
    print(f"{'':<18}{'BLAS':>8}{'float32 panels':>25}{'block panels':>25}")
    print(f"{'case':<12}{'rows':>6}{'ms':>8}{'ms':>9}{'speed-up':>9}{'GFLOP/s':>8}{'ms':>9}{'speed-up':>9}{'GFLOP/s':>8}")
    for rows in [int(r) for r in args.rows.split(",")]:
        for case, shapes, weights in (("30 layers", LAYER_SHAPES, layer_weights), ("vocab head", [VOCAB_SHAPE], vocab_weight)):
            row = _compare(case, shapes, weights, rows, args.reps)
            results.append(row)
            print(f"{row.case:<12}{row.rows:>6}{row.blas_ms:>8.1f}{row.packed_ms:>9.1f}{row.speedup:>8.2f}x"
                  f"{row.packed_gflops:>8.0f}{row.blocks_ms:>9.1f}{row.blocks_speedup:>8.2f}x{row.blocks_gflops:>8.0f}")
    if args.save_result:
        with open(args.save_result, "w", encoding="utf-8") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                       "rows": [asdict(r) for r in results]}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
