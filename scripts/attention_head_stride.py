"""Decode attention (the C++ paged kernel) at equal bytes a step, with more or fewer kv heads
(docs/benchmarks.md, "Decode attention without GQA", rounds 4 and 5).

The cache is [block, token, kv head, dim], so one head's 128-byte rows lie kv_heads x 128 bytes
apart. Round 5 found the gap between the cases is per-head work, not that distance: items reading
whole rows and a cache-resident layer leave it as it is. Each case reads 16 sequences x context x
kv heads x 64 dims of bfloat16 per layer (16 MiB), one query head per kv head, over 24 layers
each with its own cache (read from memory); best of 5; prefetching into L1, the level this Zen 3
measures.

    .venv/bin/python scripts/attention_head_stride.py [--rounds 2] [--cache-dtype float32] [--layers 1] [--prefetch-to-l2]

``--prefetch-to-l2`` prefetches into L2 only (the level the start-up tuning may choose,
docs/kernels.md "Prefetch level").
"""
from __future__ import annotations

import argparse
import time

import torch

from pagellm.kernels import ops

SEQS, HEAD_DIM, BLOCK = 16, 64, 16
CASES = ((32, 256), (8, 1024), (2, 4096))  # (kv heads, context): the same bytes a layer


def seconds_per_step(kv_heads: int, context: int, dtype: torch.dtype, layers: int, to_l2: bool = False) -> tuple[float, int]:
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = SEQS * blocks_per_seq
    caches = [torch.randn(2, num_blocks, BLOCK, kv_heads, HEAD_DIM, generator=gen).to(dtype) for _ in range(layers)]
    block_table = torch.randperm(num_blocks, generator=gen).to(torch.int32).view(SEQS, blocks_per_seq).contiguous()
    query = torch.randn(SEQS, kv_heads, HEAD_DIM, generator=gen)
    out = torch.empty_like(query)
    seq_lens = torch.full((SEQS,), context, dtype=torch.int32)
    query_start_loc = torch.arange(SEQS + 1, dtype=torch.int32)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for cache in caches:
            ops.paged_attention(out, query, cache, block_table, seq_lens, query_start_loc, HEAD_DIM**-0.5, to_l2)
        best = min(best, time.perf_counter() - start)
    return best, sum(c.numel() * c.element_size() for c in caches)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cache-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--layers", type=int, default=24, help="caches read in turn; 1 stays in the CPU's caches")
    parser.add_argument("--prefetch-to-l2", action="store_true", help="prefetch into L2 only")
    args = parser.parse_args()
    if not ops.available():
        print(f"the C++ kernels are unavailable: {ops.load_error()}")
        return 1
    dtype = getattr(torch, args.cache_dtype)
    row_bytes = HEAD_DIM * dtype.itemsize
    print(f"| kv heads x context | stride between one head's rows | ms for {args.layers} layers | GB/s |")
    for _ in range(args.rounds):
        for kv_heads, context in CASES:
            best, nbytes = seconds_per_step(kv_heads, context, dtype, args.layers, args.prefetch_to_l2)
            print(f"| {kv_heads} x {context} | {kv_heads * row_bytes} B | {best * 1e3:.1f} | {nbytes / best / 1e9:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
