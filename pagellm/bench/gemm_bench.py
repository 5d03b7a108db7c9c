"""Micro-benchmark of the linear layers: BLAS (``F.linear``) against the packed small-batch kernel.

    python -m pagellm.bench.gemm_bench [--rows 1,8,16,32,64,128,256,1024] [--save-result out.json]

Runs the four projections of every SmolLM2-135M layer (q/k/v, o, gate/up, down) with 30 layers'
worth of distinct weights, so that, as in the model, the weights stream from memory rather than
sitting in cache. For each batch size (rows) both paths run in turns; the table shows the fastest
pass over all layers for each, the ratio and the packed path's GFLOP/s. The vocabulary head
(576 -> 49,152) is timed separately.
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

from pagellm.kernels.build import load_kernels
from pagellm.models.layers import pack_weight

# (in, out) of SmolLM2-135M's fused projections, and its depth and vocabulary head.
LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
NUM_LAYERS = 30
VOCAB_SHAPE = (576, 49152)


@dataclass
class GemmRow:
    case: str
    rows: int
    blas_ms: float
    packed_ms: float
    speedup: float
    packed_gflops: float


def _best_of(fn: Callable[[], None], reps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _compare(case: str, shapes: list[tuple[int, int]], weights: list[torch.Tensor], rows: int, reps: int) -> GemmRow:
    packed = [pack_weight(w) for w in weights]
    inputs = [torch.randn(rows, shapes[i % len(shapes)][0]) for i in range(len(shapes))]
    outputs = [torch.empty(rows, w.shape[0]) for w in weights]

    def blas() -> None:
        for i, w in enumerate(weights):
            F.linear(inputs[i % len(inputs)], w)

    def packed_path() -> None:
        for i, p in enumerate(packed):
            torch.ops.pagellm_gemm.linear_packed(outputs[i], inputs[i % len(inputs)], p, None)

    blas_s = packed_s = float("inf")
    for _ in range(2):  # alternate, so drift on a shared machine hits both
        blas_s = min(blas_s, _best_of(blas, reps))
        packed_s = min(packed_s, _best_of(packed_path, reps))
    flops = 2 * rows * sum(w.numel() for w in weights)
    return GemmRow(case, rows, blas_s * 1e3, packed_s * 1e3, blas_s / packed_s, flops / packed_s / 1e9)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,16,32,64,128,256,1024")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--save-result", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if not load_kernels():
        print("the C++ kernels are unavailable; nothing to compare")
        return 1
    torch.manual_seed(0)
    layer_weights = [torch.randn(n, k) * 0.05 for _ in range(NUM_LAYERS) for k, n in LAYER_SHAPES]
    vocab_weight = [torch.randn(VOCAB_SHAPE[1], VOCAB_SHAPE[0]) * 0.05]
    results = []
    print(f"{'case':<12}{'rows':>6}{'BLAS ms':>10}{'packed ms':>11}{'speed-up':>10}{'GFLOP/s':>9}")
    for rows in [int(r) for r in args.rows.split(",")]:
        for case, shapes, weights in (("30 layers", LAYER_SHAPES, layer_weights), ("vocab head", [VOCAB_SHAPE], vocab_weight)):
            row = _compare(case, shapes, weights, rows, args.reps)
            results.append(row)
            print(f"{row.case:<12}{row.rows:>6}{row.blas_ms:>10.1f}{row.packed_ms:>11.1f}{row.speedup:>9.2f}x{row.packed_gflops:>9.0f}")
    if args.save_result:
        with open(args.save_result, "w", encoding="utf-8") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                       "rows": [asdict(r) for r in results]}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
