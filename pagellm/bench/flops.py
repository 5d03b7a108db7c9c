"""``pagellm bench mfu``: the machine's matrix-multiply peak, and model FLOP utilization of runs.

    pagellm bench mfu --result pagellm-random.json vllm-random.json --params 134.5e6

The peak is measured now, in the same run, with torch's fp32 matmul on large square matrices;
a result's MFU is ``2 * params * (input + output tokens) / duration / peak``, the workload's
FLOPs (a dense forward pass per token) over what the machine could have done in that time.
Results are ``bench serve`` JSON files (vLLM's keys: total_input_tokens, total_output_tokens,
duration), so other engines' runs can be put side by side.
"""
from __future__ import annotations

import argparse
import json
import time
from typing import Optional

# SmolLM2-135M-Instruct: embeddings (tied) + 30 decoder layers.
DEFAULT_MODEL_PARAMS = 134.5e6


def measure_matmul_peak(num_threads: Optional[int] = None, size: int = 1536, dtype_name: str = "float32", seconds: float = 3.0) -> float:
    """Best GFLOP/s of repeated ``size``-cubed matmuls, in torch, as the engine runs them."""
    import torch

    if num_threads:
        torch.set_num_threads(num_threads)
    dtype = getattr(torch, dtype_name)
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    out = torch.empty(size, size, dtype=dtype)
    torch.mm(a, b, out=out)  # warm-up
    best = 0.0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t = time.perf_counter()
        torch.mm(a, b, out=out)
        best = max(best, 2 * size**3 / (time.perf_counter() - t) / 1e9)
    return best


def model_flop_utilization(num_tokens: int, duration_s: float, peak_gflops: float, params: float = DEFAULT_MODEL_PARAMS) -> float:
    if duration_s <= 0 or peak_gflops <= 0:
        raise ValueError("duration and peak must be positive")
    return 2 * params * num_tokens / duration_s / (peak_gflops * 1e9)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--result", nargs="*", default=[], help="bench serve JSON results to rate")
    parser.add_argument("--params", type=float, default=DEFAULT_MODEL_PARAMS, help="model parameters (default SmolLM2-135M)")
    parser.add_argument("--num-threads", type=int, default=None, help="threads for the peak (default: torch's)")
    parser.add_argument("--seconds", type=float, default=3.0, help="how long to measure the peak")
    parser.add_argument(
        "--peak-floor", type=float, default=0.0, metavar="GFLOPS",
        help="rate against at least this peak, e.g. one measured before the runs: on a shared machine the "
        "peak drifts, and the higher of the two keeps the MFU from being flattered by a slow moment",
    )


def main(args: argparse.Namespace) -> int:
    import torch

    peak = measure_matmul_peak(args.num_threads, seconds=args.seconds)
    print(f"fp32 matmul peak ({torch.get_num_threads()} threads): {peak:.1f} GFLOP/s")
    if args.peak_floor > peak:
        peak = args.peak_floor
        print(f"rated against the higher peak given: {peak:.1f} GFLOP/s")
    for path in args.result:
        with open(path) as f:
            result = json.load(f)
        num_tokens = result["total_input_tokens"] + result["total_output_tokens"]
        mfu = model_flop_utilization(num_tokens, result["duration"], peak, args.params)
        print(
            f"{path}: {num_tokens} tokens in {result['duration']:.1f} s = "
            f"{2 * args.params * num_tokens / result['duration'] / 1e9:.1f} GFLOP/s, MFU {100 * mfu:.1f}%"
        )
    return 0
