"""Micro-benchmark of the attention backends on SmolLM2-135M shapes.

    python -m pagellm.bench.attention_bench [--cases decode,prefill,mixed] [--layers 1] [--sliding-window 512] [--save-result out.json]

For each case every backend runs the same batch; the table shows the median and the fastest
time per call, the median speed-up over the torch reference, the achieved rate at the median
(KV-cache GB/s for decode, counting a shared prefix once per sequence; attention GFLOP/s
otherwise) and the largest difference from the reference output. With ``--layers N`` a call is N
layers, each with its own copy of the KV cache, as in a model's step: the cache then comes from
memory rather than from the caches a single repeated call keeps it in. ``--kv-cache-dtype`` takes
a comma-separated list (``bfloat16,fp8,int8``): each case then runs once per cache type, in one
process, so the types compare under the same machine load. ``--sliding-window W`` runs every case
as a sliding-window layer (AttentionOptions); rates then count only the keys inside the windows.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from pagellm.attention.backend import AttentionOptions
from pagellm.attention.kv_quant import bytes_per_token_head, kv_cache_dtype_name
from pagellm.attention.selector import BACKEND_NAMES, get_attn_backend
from pagellm.attention.synthetic import SyntheticBatch, make_batch
from pagellm.config import KV_CACHE_DTYPE_NAMES, parse_dtype

# SmolLM2-135M attention, the default shape (--heads gives another model's).
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16


@dataclass(frozen=True)
class HeadShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int


SMOLLM2_HEADS = HeadShape(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)


def parse_heads(text: str) -> HeadShape:
    """``"8,2,256"``: query heads, kv heads, head size."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--heads takes three positive integers, query heads,kv heads,head size; got {text!r}")
    shape = HeadShape(*(int(p) for p in parts))
    if shape.num_heads % shape.num_kv_heads:
        raise ValueError(f"--heads: {shape.num_heads} query heads do not divide into {shape.num_kv_heads} kv heads")
    return shape

CASES: dict[str, list[tuple[int, int]]] = {
    "decode": [(1, 1024)] * 32,
    "decode_short": [(1, 256)] * 32,
    # Long contexts, for sliding windows: with --sliding-window 512, decode_4k should cost what decode_512 does.
    "decode_4k": [(1, 4096)] * 8,
    "decode_512": [(1, 512)] * 8,
    "prefill": [(512, 512)] * 4,
    # A typical continuous-batching step: decodes plus one prefill chunk after a cached prefix.
    "mixed": [(1, 256 + 24 * i) for i in range(31)] + [(512, 1024)],
    # Workload P's decode: 4 system prompts of 512 tokens, each the prefix of 8 sequences.
    "decode_prefix": [(1, 608)] * 32,
    # One stream's speculative verification: 8 drafts and the last token, after a 600-token context.
    "verify": [(9, 609)],
    # The same stream's plain decode step, for what verification adds.
    "decode_one": [(1, 609)],
}
# case -> (number of prefixes, prefix tokens) shared through the block tables, as prefix caching does.
SHARED_PREFIXES: dict[str, tuple[int, int]] = {"decode_prefix": (4, 512)}


@dataclass
class BenchRow:
    case: str
    backend: str
    ms_per_call: float  # median
    best_ms: float  # fastest call: the better figure on a machine shared with other work
    speedup_vs_ref: float
    rate: float
    rate_unit: str
    max_abs_diff: float
    kv_cache_dtype: str = "float32"
    sliding_window: Optional[int] = None


def attention_flops(seqs: list[tuple[int, int]], window: Optional[int] = None, heads: HeadShape = SMOLLM2_HEADS) -> float:
    """Multiply-adds x2 of QK^T and PV over the causally visible keys (inside the window, if any)."""
    flops = 0.0
    for q_len, seq_len in seqs:
        visible = sum(min(seq_len - q_len + i + 1, window or seq_len) for i in range(q_len))
        flops += 4.0 * visible * heads.num_heads * heads.head_dim
    return flops


def kv_bytes(
    seqs: list[tuple[int, int]], cache_dtype: torch.dtype = torch.float32, window: Optional[int] = None, heads: HeadShape = SMOLLM2_HEADS
) -> float:
    """Bytes of K and V the contexts hold in a cache of ``cache_dtype`` (an int8 row's scale included),
    or with a window the bytes of the keys a decode sees."""
    tokens = sum(min(seq_len, window or seq_len) for _, seq_len in seqs)
    return float(tokens) * 2 * heads.num_kv_heads * bytes_per_token_head(heads.head_dim, cache_dtype)


def share_prefixes(batch: SyntheticBatch, num_prefixes: int, prefix_tokens: int, seed: int = 0) -> None:
    """Gives the sequences ``num_prefixes`` common prefixes of ``prefix_tokens`` (as many sequences
    each), in a seeded random order: in a running batch, requests that share a system prompt are
    not next to each other. Each prefix's first sequence keeps its blocks, the others point at them."""
    table = batch.metadata.block_table
    num_seqs, shared_blocks = table.shape[0], prefix_tokens // BLOCK_SIZE
    prefix_of = [i % num_prefixes for i in range(num_seqs)]
    random.Random(seed).shuffle(prefix_of)
    owner: dict[int, int] = {}
    for i, prefix in enumerate(prefix_of):
        first = owner.setdefault(prefix, i)
        table[i, :shared_blocks] = table[first, :shared_blocks]


def time_backend(
    backend_name: str,
    batch: SyntheticBatch,
    min_seconds: float,
    max_repeats: int,
    num_layers: int = 1,
    options: Optional[AttentionOptions] = None,
) -> tuple[float, float, torch.Tensor]:
    """(median seconds, fastest seconds, output) of one backend's forward on ``batch``, ``num_layers``
    times over as many copies of the KV cache."""
    backend = get_attn_backend(backend_name, batch.query.device)
    caches = [batch.kv_cache.clone() for _ in range(num_layers)]

    def call() -> torch.Tensor:
        for cache in caches:
            out = backend.forward(
                batch.query, batch.key, batch.value, cache, batch.metadata, batch.scale, batch.kv_scales, options
            )
        return out

    output = call()  # warm-up (and the output checked against the reference)
    times: list[float] = []
    deadline = time.perf_counter() + min_seconds
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < max_repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), output


def run_case(
    case: str,
    backend_names: list[str],
    min_seconds: float,
    max_repeats: int,
    num_layers: int = 1,
    cache_dtype: torch.dtype = torch.float32,
    sliding_window: Optional[int] = None,
    heads: HeadShape = SMOLLM2_HEADS,
) -> list[BenchRow]:
    seqs = CASES[case]
    batch = make_batch(seqs, heads.num_heads, heads.num_kv_heads, heads.head_dim, BLOCK_SIZE, seed=0, cache_dtype=cache_dtype)
    if case in SHARED_PREFIXES:
        share_prefixes(batch, *SHARED_PREFIXES[case])
    options = AttentionOptions(sliding_window=sliding_window)
    ref_timing = time_backend("torch_ref", batch, min_seconds, max_repeats, num_layers, options)
    ref_seconds, ref_out = ref_timing[0], ref_timing[2]
    rows = []
    for name in backend_names:
        seconds, best, out = (
            ref_timing if name == "torch_ref" else time_backend(name, batch, min_seconds, max_repeats, num_layers, options)
        )
        if case.startswith("decode"):
            rate, unit = num_layers * kv_bytes(seqs, cache_dtype, sliding_window, heads) / seconds / 1e9, "GB/s"
        else:
            rate, unit = num_layers * attention_flops(seqs, sliding_window, heads) / seconds / 1e9, "GFLOP/s"
        diff = (out - ref_out).abs().max().item()
        rows.append(
            BenchRow(
                case, name, seconds * 1e3, best * 1e3, ref_seconds / seconds, rate, unit, diff, kv_cache_dtype_name(cache_dtype),
                sliding_window,
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="decode,prefill,mixed", help=f"comma-separated, from {', '.join(CASES)}")
    parser.add_argument("--backends", default=",".join(BACKEND_NAMES), help="comma-separated backend names")
    parser.add_argument("--min-seconds", type=float, default=1.0, help="time each backend for at least this long")
    parser.add_argument("--max-repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads before timing")
    parser.add_argument("--layers", type=int, default=1, help="layers per call, each with its own copy of the cache")
    parser.add_argument(
        "--kv-cache-dtype",
        default="float32",
        help="the cache's element type(s), comma-separated: float32, float16, bfloat16, fp8 (fp8_e4m3), fp8_e5m2, int8",
    )
    parser.add_argument("--sliding-window", type=int, default=None, metavar="W", help="attend with a sliding window of W tokens")
    parser.add_argument(
        "--heads",
        default="9,3,64",
        metavar="Q,KV,D",
        help="query heads, kv heads, head size (default SmolLM2-135M's; Gemma 4's layers: 8,2,256 and 8,2,512)",
    )
    parser.add_argument("--save-result", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    heads = parse_heads(args.heads)
    if args.sliding_window is not None and args.sliding_window < 1:
        raise ValueError(f"--sliding-window must be at least 1, got {args.sliding_window}")
    cache_dtypes = [KV_CACHE_DTYPE_NAMES.get(n) or parse_dtype(n) for n in args.kv_cache_dtype.lower().split(",") if n]
    if args.layers < 1:
        raise ValueError(f"--layers must be at least 1, got {args.layers}")
    if args.threads:
        torch.set_num_threads(args.threads)
    cases = [c for c in args.cases.split(",") if c]
    backends = [b for b in args.backends.split(",") if b]
    for case in cases:
        if case not in CASES:
            raise ValueError(f"unknown case {case!r}; choose from {', '.join(CASES)}")
    rows: list[BenchRow] = []
    header = f"{'case':<13}{'cache':<10}{'backend':<12}{'ms/call':>10}{'best ms':>10}{'vs ref':>9}{'rate':>10} {'unit':<8}{'max|diff|':>11}"
    print(f"attention micro-benchmark: heads {heads.num_heads}/{heads.num_kv_heads}, head_dim {heads.head_dim}, block {BLOCK_SIZE}, "
          f"{torch.get_num_threads()} threads, {args.layers} layer(s) per call"
          + (f", sliding window {args.sliding_window}" if args.sliding_window else ""))
    print(header)
    print("-" * len(header))
    for case, cache_dtype in ((c, d) for c in cases for d in cache_dtypes):
        for row in run_case(case, backends, args.min_seconds, args.max_repeats, args.layers, cache_dtype, args.sliding_window, heads):
            rows.append(row)
            print(f"{row.case:<13}{row.kv_cache_dtype:<10}{row.backend:<12}{row.ms_per_call:>10.3f}{row.best_ms:>10.3f}"
                  f"{row.speedup_vs_ref:>8.1f}x{row.rate:>10.1f} {row.rate_unit:<8}{row.max_abs_diff:>11.2e}")
    worst = max((r.max_abs_diff for r in rows), default=0.0)
    agree = worst < 1e-4
    print(f"all backends agree with torch_ref: {agree} (max |diff| {worst:.2e})")
    if args.save_result:
        result = {
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "machine": platform.machine(),
            "shapes": {**asdict(heads), "block_size": BLOCK_SIZE},
            "cases": {c: CASES[c] for c in cases},
            "layers": args.layers,
            "sliding_window": args.sliding_window,
            "kv_cache_dtypes": [kv_cache_dtype_name(d) for d in cache_dtypes],
            "rows": [asdict(r) for r in rows],
            "all_agree": agree,
        }
        with open(args.save_result, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0 if agree else 1


if __name__ == "__main__":
    raise SystemExit(main())
