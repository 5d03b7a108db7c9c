"""Time one mixture-of-experts layer on the int8 GGUF path: the fused op against the per-expert loop.

Builds a :class:`~pagellm.layers.moe.FusedMoE` of random GGUF blocks (by default Qwen3-30B-A3B's
shape: hidden 2048, 128 experts, top-8, expert intermediate 768, Q4_K gate/up and down) and, per
token count, times in the same run and interleaved:

- the layer with ``ops.moe_int8`` (one native call for every used expert's products),
- the layer with the per-expert loop (``GatedMLP`` calls, the fallback),
- the used experts' ``GatedMLP`` calls alone, back to back (no routing or gathers).

Each figure is the best of ``--repeats`` means of ``--iters`` calls, so compare them as ratios.

    .venv/bin/python scripts/moe_layer_bench.py --tokens 1 4 16 --down-type Q6_K
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from gguf import GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from gguf_blocks import random_moe_layer

from pagellm.kernels import ops
from pagellm.layers.moe import FusedMoE


def build_layer(hidden: int, experts: int, top_k: int, inter: int, gate_up_type: str, down_type: str) -> FusedMoE:
    torch.manual_seed(0)
    router = torch.randn(experts, hidden) * 0.02
    return random_moe_layer(GGMLQuantizationType[gate_up_type], GGMLQuantizationType[down_type], hidden, inter, experts, top_k, router)


def best_mean(fns: dict[str, Callable[[], object]], iters: int, repeats: int) -> dict[str, float]:
    """Seconds per call of each fn: the best of `repeats` means, the fns interleaved per repeat."""
    for fn in fns.values():
        for _ in range(3):
            fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(iters):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / iters)
    return best


def loop_layer(moe: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    """The layer on its per-expert loop (what it runs where the fused op does not apply)."""
    fused = FusedMoE._int8_args
    FusedMoE._int8_args = lambda self: None  # type: ignore[method-assign]
    try:
        return moe(x)
    finally:
        FusedMoE._int8_args = fused  # type: ignore[method-assign]


def bench_tokens(moe: FusedMoE, tokens: int, args: argparse.Namespace) -> None:
    x = torch.randn(tokens, args.hidden)
    _, ids = moe.route(x)
    counts = torch.bincount(ids.flatten(), minlength=args.experts).tolist()
    used = [e for e, c in enumerate(counts) if c]
    rows = {e: x.new_empty(counts[e], args.hidden).normal_() for e in used}

    def experts_alone() -> None:
        for e in used:
            moe.experts[e](rows[e])

    fns = {"fused": lambda: moe(x), "loop": lambda: loop_layer(moe, x), "alone": experts_alone}
    times = best_mean(fns, args.iters, args.repeats)
    assert torch.equal(moe(x), loop_layer(moe, x)), "the fused op and the loop disagree"
    print(
        f"T={tokens:3d}: {len(used):3d} experts  layer fused {times['fused'] * 1e3:6.3f} ms  "
        f"loop {times['loop'] * 1e3:6.3f} ms  (x{times['loop'] / times['fused']:.2f})  "
        f"experts alone {times['alone'] * 1e3:6.3f} ms"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16], help="tokens per step")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--inter", type=int, default=768, help="each expert's intermediate size")
    parser.add_argument("--gate-up-type", default="Q4_K", help="GGML type of gate/up (Q4_K, Q6_K, Q8_0 ...)")
    parser.add_argument("--down-type", default="Q4_K", help="GGML type of down")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not ops.moe_int8_available():
        print(f"no fused int8 MoE op in this build ({ops.load_error()})", file=sys.stderr)
        return 1
    moe = build_layer(args.hidden, args.experts, args.top_k, args.inter, args.gate_up_type, args.down_type)
    print(f"{moe.experts[0].gate_up_proj.method.form} / {moe.experts[0].down_proj.method.form}, "
          f"{torch.get_num_threads()} threads")
    for tokens in args.tokens:
        bench_tokens(moe, tokens, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
