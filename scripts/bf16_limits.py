"""How close the bfloat16 products of a 1.7B-shape model come to this CPU's limits.

    .venv/bin/python scripts/bf16_limits.py [--rounds 3]

Prints, in turns for each round:
  * peak: `vdpbf16ps` on registers alone (24 independent sums a thread, no memory), GFLOP/s over
    torch's threads: the ceiling of any bfloat16 product here;
  * prefill: `ops.linear_bf16` at 1,024 rows on SmolLM2-1.7B's gate/up and down projections, GFLOP/s
    and its share of the peak;
  * decode: the same kernel at 16 rows over 12 distinct 16,384 x 2,048 gate/up weights (768 MiB, far
    past the L3), GB/s of weights read and its share of the read rate;
  * read: `torch.ones(2**29).sum()`, the machine's read rate as the other scripts measure it;
  * int8 peak: `vpdpbusd` on registers alone, the ceiling of the GGUF blocks' int8 kernels (needs VNNI).
Needs a CPU with AVX512_BF16 (the peak probe is built with torch's inline extension loader).
"""
from __future__ import annotations

import argparse
import functools

import torch
from torch.utils.cpp_extension import load_inline

from pagellm.bench.common import best_of
from pagellm.kernels import ops

_PEAK_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <chrono>
// Seconds for `iters` rounds of 24 independent vdpbf16ps on each of `threads` threads.
double bf16_peak_seconds(int64_t iters, int64_t threads) {
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    __m512 acc[24];
    for (int i = 0; i < 24; ++i) acc[i] = _mm512_setzero_ps();
    __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f81), b = (__m512bh)_mm512_set1_epi32(0x3f803f80 + t);
    for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 24
      for (int i = 0; i < 24; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
      __asm__ volatile("" : "+v"(b));  // keeps the loop from being folded
    }
    float s = 0.f;
    for (int i = 0; i < 24; ++i) s += _mm512_reduce_add_ps(acc[i]);
    if (s == 1.2345f) __builtin_trap();
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
// The same for vpdpbusd (64 u8 x s8 products summed into 16 int32 lanes): the int8 kernels' ceiling.
// Kept apart from the bf16 loop: one template over both, on integer registers cast to float for
// vdpbf16ps, measured the bf16 peak at 0.6x (616-627 against 1,025-1,085 GFLOP/s on Zen 5).
double int8_peak_seconds(int64_t iters, int64_t threads) {
  const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads)
  {
    const int t = omp_get_thread_num();
    __m512i acc[24];
    for (int i = 0; i < 24; ++i) acc[i] = _mm512_setzero_si512();
    __m512i a = _mm512_set1_epi32(0x02020202), b = _mm512_set1_epi32(0x01010101 + t);
    for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 24
      for (int i = 0; i < 24; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
      __asm__ volatile("" : "+v"(b));
    }
    int s = 0;
    for (int i = 0; i < 24; ++i) s += _mm512_reduce_add_epi32(acc[i]);
    if (s == 12345) __builtin_trap();
  }
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
"""


def peak_gflops(module, iters: int = 8_000_000) -> float:
    seconds = module.bf16_peak_seconds(iters, torch.get_num_threads())
    return torch.get_num_threads() * iters * 24 * 64 / seconds / 1e9  # 32 products + 32 sums an instruction


def int8_peak_gops(module, iters: int = 8_000_000) -> float:
    seconds = module.int8_peak_seconds(iters, torch.get_num_threads())
    return torch.get_num_threads() * iters * 24 * 128 / seconds / 1e9  # 64 products + 64 sums an instruction


def prefill_gflops() -> float:
    flops, seconds = 0.0, 0.0
    for n, k, gate_up in ((16384, 2048, True), (2048, 8192, False)):
        packed = ops.pack_weight_bf16(torch.randn(n, k).to(torch.bfloat16), gate_up)
        x = torch.randn(1024, k)
        out = torch.empty(1024, n // 2 if gate_up else n)
        seconds += best_of(functools.partial(ops.linear_bf16, out, x, packed, None, "silu" if gate_up else None), 3)
        flops += 2.0 * 1024 * n * k
    return flops / seconds / 1e9


def decode_gbps(weights: list[torch.Tensor]) -> float:
    x = torch.randn(16, 2048)
    out = torch.empty(16, 8192)

    def one_pass() -> None:
        for packed in weights:
            ops.linear_bf16(out, x, packed, None, "silu")

    seconds = best_of(one_pass, 3)
    return sum(w.numel() * w.element_size() for w in weights) / seconds / 1e9


def read_gbps() -> float:
    x = torch.ones(2**29)
    return x.numel() * 4 / best_of(x.sum, 5) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if not ops.bf16_matmul_available():
        raise SystemExit("needs the native kernels on a CPU with AVX512_BF16")
    module = load_inline(
        "pagellm_bf16_peak", _PEAK_SOURCE, functions=["bf16_peak_seconds", "int8_peak_seconds"],
        extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False,
    )
    weights = [ops.pack_weight_bf16(torch.randn(16384, 2048).to(torch.bfloat16), True) for _ in range(12)]
    print(f"{torch.get_num_threads()} threads")
    for r in range(args.rounds):
        peak, prefill = peak_gflops(module), prefill_gflops()
        decode, read = decode_gbps(weights), read_gbps()
        print(
            f"round {r + 1}: peak {peak:.0f} GFLOP/s | prefill (1,024 rows) {prefill:.0f} GFLOP/s, {prefill / peak:.0%} of peak"
            f" | decode (16 rows) {decode:.1f} GB/s, {decode / read:.0%} of the read rate {read:.1f} GB/s"
            f" | int8 peak {int8_peak_gops(module):.0f} GOP/s"
        )


if __name__ == "__main__":
    main()
