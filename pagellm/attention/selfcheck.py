"""A quick agreement check of the fast backends against the reference, after a kernel build.

``python -m pagellm.attention.selfcheck`` builds (or loads) the C++ kernels and runs the check;
the setup script calls it. It lives here rather than in ``pagellm.kernels.build`` because the
kernels are the bottom layer: they must not import attention, which sits on top of them.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from pagellm.attention.backend import AttentionOptions
from pagellm.attention.selector import get_attn_backend
from pagellm.attention.synthetic import make_batch
from pagellm.kernels import build

# Mixed: a fresh prefill, a chunk after a cached prefix, decodes, a block-multiple context.
SELFCHECK_SEQS = [(37, 37), (20, 75), (1, 1), (1, 130), (1, 64), (16, 64)]
MAX_ERROR = 1e-4


def run_selfcheck(backend_name: str = "cpu_paged") -> float:
    """Max absolute difference between ``backend_name`` and torch_ref on a small mixed batch, plain
    and with every AttentionOptions field on (a window, a soft cap and sinks)."""
    reference = get_attn_backend("torch_ref", "cpu")
    backend = get_attn_backend(backend_name, "cpu")
    worst = 0.0
    for num_heads, num_kv_heads, head_dim in ((9, 3, 64), (4, 4, 32)):
        sinks = torch.linspace(-2.0, 2.0, num_heads)
        for options in (None, AttentionOptions(sliding_window=21, logits_soft_cap=5.0, sinks=sinks)):
            batch = make_batch(SELFCHECK_SEQS, num_heads, num_kv_heads, head_dim, block_size=16, seed=1)
            cache = batch.kv_cache.clone()
            args = (batch.metadata, batch.scale, None, options)
            expected = reference.forward(batch.query, batch.key, batch.value, batch.kv_cache, *args)
            got = backend.forward(batch.query, batch.key, batch.value, cache, *args)
            worst = max(worst, (got - expected).abs().max().item())
            if not torch.isfinite(got).all():
                return float("inf")
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build pagellm's C++ CPU kernels and check attention against the reference.")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if not build.load_kernels(verbose=args.verbose):
        print(f"build failed: {build.load_error()}", file=sys.stderr)
        return 1
    print(f"CPU kernels ready under {build.cache_dir()} ({time.perf_counter() - start:.1f}s)")
    max_err = run_selfcheck()
    print(f"self-check against the reference: max abs error {max_err:.2e}")
    return 0 if max_err < MAX_ERROR else 1


if __name__ == "__main__":
    raise SystemExit(main())
