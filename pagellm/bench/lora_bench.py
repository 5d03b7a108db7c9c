"""Micro-benchmark of batched multi-LoRA's grouped low-rank update, ``ops.lora_shrink_expand``.

    python -m pagellm.bench.lora_bench [--ranks 8,16,32,64] [--shapes 576x960,2048x16384] [--threads N] [--save-result out.json]

Decode: 32 rows, each its own adapter (32 segments of one row), for each (in, out) shape, rank and
pool dtype (float32, bfloat16). As in a model's layers, the weights stream from memory: the pass
runs over enough distinct adapter pools (one per "layer") to read ``--stream-mib`` of weights.
Reported per call: the kernel's time, the GB/s of adapter weights it reads (every used slot's A and
B once), the GB/s of a ``torch.sum`` over the same bytes read as float32 (what reading them costs
at best), the
torch reference loop's time (``ops.lora_shrink_expand_reference``: two matmuls per segment) and
the kernel's speed-up over it, all in one run.

Prefill: ``--prefill-segments`` segments of each length in ``--prefill-rows``, each its own adapter,
through the kernel's own loops and through ATen's matmul per run (the two sides of
``ops.LORA_ATEN_MIN_ROWS``), against the reference loop.
"""
from __future__ import annotations

import argparse
import json
import platform
from dataclasses import asdict, dataclass

import torch

from pagellm.bench.common import best_of, positive_int_list
from pagellm.kernels import ops

DECODE_ROWS = 32
# Always the kernel's own loops, or ATen from the first row.
NATIVE_ONLY = 1 << 62
ATEN_ALWAYS = 1


@dataclass
class LoraPools:
    """Distinct adapter pools of one shape, with the tensors of one call's batch."""

    lora_a: list[torch.Tensor]
    lora_b: list[torch.Tensor]
    x: torch.Tensor
    y: torch.Tensor
    seg_starts: torch.Tensor
    seg_slots: torch.Tensor

    def run(self, aten_min_rows: int = ops.LORA_ATEN_MIN_ROWS) -> None:
        for a, b in zip(self.lora_a, self.lora_b):
            ops.lora_shrink_expand(self.y, self.x, a, b, self.seg_starts, self.seg_slots, aten_min_rows=aten_min_rows)

    def run_reference(self) -> None:
        for a, b in zip(self.lora_a, self.lora_b):
            ops.lora_shrink_expand_reference(self.y, self.x, a, b, self.seg_starts, self.seg_slots)

    def read_weights(self) -> None:
        # as float32, whatever the pool's dtype: a sum of bfloat16 runs slower than memory on some CPUs
        for a, b in zip(self.lora_a, self.lora_b):
            a.reshape(-1).view(torch.float32).sum()
            b.reshape(-1).view(torch.float32).sum()

    def bytes_per_call(self) -> int:
        """Bytes of every used slot's A and B, in one pool."""
        used = len(set(self.seg_slots.tolist()) - {-1})
        a, b = self.lora_a[0], self.lora_b[0]
        return used * (a[0].numel() + b[0].numel()) * a.element_size()


def make_pools(
    in_features: int, out_features: int, rank: int, dtype: torch.dtype, segment_rows: list[int], stream_bytes: int, seed: int = 0
) -> LoraPools:
    """One slot per segment; as many pools as it takes to hold ``stream_bytes`` (at least 2)."""
    num_slots = len(segment_rows)
    pool_bytes = num_slots * rank * (in_features + out_features) * torch.finfo(dtype).bits // 8
    num_pools = max(2, -(-stream_bytes // pool_bytes))
    gen = torch.Generator().manual_seed(seed)
    lora_a = [(torch.randn(num_slots, rank, in_features, generator=gen) * 0.02).to(dtype) for _ in range(num_pools)]
    lora_b = [(torch.randn(num_slots, out_features, rank, generator=gen) * 0.02).to(dtype) for _ in range(num_pools)]
    num_tokens = sum(segment_rows)
    starts = torch.tensor([0, *segment_rows], dtype=torch.int64).cumsum(0)
    return LoraPools(lora_a, lora_b, torch.randn(num_tokens, in_features, generator=gen), torch.zeros(num_tokens, out_features),
                     starts, torch.arange(num_slots, dtype=torch.int64))


@dataclass
class DecodeRow:
    in_features: int
    out_features: int
    rank: int
    dtype: str
    num_pools: int
    kernel_ms: float  # per call
    kernel_gb_s: float  # adapter weight bytes read per second
    sum_gb_s: float  # torch.sum over the same bytes
    reference_ms: float
    speedup: float  # reference / kernel


@dataclass
class PrefillRow:
    in_features: int
    out_features: int
    rank: int
    dtype: str
    segment_rows: int
    num_segments: int
    loops_ms: float  # the kernel's own loops, per call
    aten_ms: float  # ATen's matmul per run
    reference_ms: float
    loops_vs_aten: float  # aten / loops: above 1, the loops are faster


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def decode_case(in_features: int, out_features: int, rank: int, dtype: torch.dtype, reps: int, stream_bytes: int) -> DecodeRow:
    pools = make_pools(in_features, out_features, rank, dtype, [1] * DECODE_ROWS, stream_bytes)
    kernel_s = reference_s = sum_s = float("inf")
    for _ in range(2):  # alternate, so drift on a shared machine hits all of them
        kernel_s = min(kernel_s, best_of(pools.run, reps))
        sum_s = min(sum_s, best_of(pools.read_weights, reps))
        reference_s = min(reference_s, best_of(pools.run_reference, reps))
    num_pools = len(pools.lora_a)
    total_bytes = pools.bytes_per_call() * num_pools
    return DecodeRow(in_features, out_features, rank, _dtype_name(dtype), num_pools, kernel_s / num_pools * 1e3,
                     total_bytes / kernel_s / 1e9, total_bytes / sum_s / 1e9, reference_s / num_pools * 1e3,
                     reference_s / kernel_s)


def prefill_case(
    in_features: int, out_features: int, rank: int, dtype: torch.dtype, segment_rows: int, num_segments: int, reps: int
) -> PrefillRow:
    pools = make_pools(in_features, out_features, rank, dtype, [segment_rows] * num_segments, 0)
    loops_s = aten_s = reference_s = float("inf")
    for _ in range(2):
        loops_s = min(loops_s, best_of(lambda: pools.run(NATIVE_ONLY), reps))
        aten_s = min(aten_s, best_of(lambda: pools.run(ATEN_ALWAYS), reps))
        reference_s = min(reference_s, best_of(pools.run_reference, reps))
    num_pools = len(pools.lora_a)
    return PrefillRow(in_features, out_features, rank, _dtype_name(dtype), segment_rows, num_segments, loops_s / num_pools * 1e3,
                      aten_s / num_pools * 1e3, reference_s / num_pools * 1e3, aten_s / loops_s)


def _shape_list(text: str) -> list[tuple[int, int]]:
    shapes = []
    for part in text.split(","):
        fields = part.lower().split("x")
        if len(fields) != 2 or not all(f.isdigit() and int(f) > 0 for f in fields):
            raise ValueError(f"expected shapes as IN x OUT, e.g. 576x960, got {part!r}")
        shapes.append((int(fields[0]), int(fields[1])))
    return shapes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=_shape_list, default=_shape_list("576x960,2048x16384"), help="IN x OUT, comma-separated")
    parser.add_argument("--ranks", type=positive_int_list, default=[8, 16, 32, 64])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--stream-mib", type=int, default=256, help="distinct adapter weights per decode pass")
    parser.add_argument("--prefill-rows", type=positive_int_list, default=[8, 32, 256], help="rows per prefill segment")
    parser.add_argument("--prefill-segments", type=int, default=4)
    parser.add_argument("--prefill-ranks", type=positive_int_list, default=[16, 64])
    parser.add_argument("--no-decode", action="store_true")
    parser.add_argument("--no-prefill", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch's threads (default: as torch starts)")
    parser.add_argument("--save-result", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if not ops.available():
        print(f"the C++ kernels are unavailable ({ops.load_error()}); nothing to compare")
        return 1
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    print(f"{torch.get_num_threads()} threads\ndecode: {DECODE_ROWS} rows, each its own adapter; ms per call")
    print(f"{'in -> out':<14}{'rank':>5}{'pool':>10}{'pools':>6}{'kernel ms':>11}{'GB/s':>7}{'sum GB/s':>9}{'ref ms':>9}{'speed-up':>9}")
    decode_rows = []
    for in_features, out_features in [] if args.no_decode else args.shapes:
        for rank in args.ranks:
            for dtype in dtypes:
                row = decode_case(in_features, out_features, rank, dtype, args.reps, args.stream_mib << 20)
                decode_rows.append(row)
                print(f"{f'{in_features} -> {out_features}':<14}{rank:>5}{row.dtype:>10}{row.num_pools:>6}{row.kernel_ms:>11.3f}"
                      f"{row.kernel_gb_s:>7.1f}{row.sum_gb_s:>9.1f}{row.reference_ms:>9.3f}{row.speedup:>8.2f}x")
    prefill_rows = []
    if not args.no_prefill:
        print(f"\nprefill: {args.prefill_segments} segments of each length, each its own adapter; ms per call")
        print(f"{'in -> out':<14}{'rank':>5}{'pool':>10}{'rows':>6}{'loops ms':>10}{'ATen ms':>9}{'ref ms':>9}{'ATen/loops':>11}")
        for in_features, out_features in args.shapes:
            for rank in args.prefill_ranks:
                for dtype in dtypes:
                    for rows in args.prefill_rows:
                        row = prefill_case(in_features, out_features, rank, dtype, rows, args.prefill_segments, args.reps)
                        prefill_rows.append(row)
                        print(f"{f'{in_features} -> {out_features}':<14}{rank:>5}{row.dtype:>10}{rows:>6}{row.loops_ms:>10.3f}"
                              f"{row.aten_ms:>9.3f}{row.reference_ms:>9.3f}{row.loops_vs_aten:>10.2f}x")
    if args.save_result:
        with open(args.save_result, "w", encoding="utf-8") as f:
            json.dump({"machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                       "decode": [asdict(r) for r in decode_rows], "prefill": [asdict(r) for r in prefill_rows]}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
