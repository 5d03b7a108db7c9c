"""A quick agreement check of the fast backends against the reference (used after a build)."""
from __future__ import annotations

import torch

from pagellm.attention.selector import get_attn_backend
from pagellm.attention.synthetic import make_batch

# Mixed: a fresh prefill, a chunk after a cached prefix, decodes, a block-multiple context.
SELFCHECK_SEQS = [(37, 37), (20, 75), (1, 1), (1, 130), (1, 64), (16, 64)]


def run_selfcheck(backend_name: str = "cpu_paged") -> float:
    """Max absolute difference between ``backend_name`` and torch_ref on a small mixed batch."""
    reference = get_attn_backend("torch_ref", "cpu")
    backend = get_attn_backend(backend_name, "cpu")
    worst = 0.0
    for num_heads, num_kv_heads, head_dim in ((9, 3, 64), (4, 4, 32)):
        batch = make_batch(SELFCHECK_SEQS, num_heads, num_kv_heads, head_dim, block_size=16, seed=1)
        cache = batch.kv_cache.clone()
        expected = reference.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata, batch.scale)
        got = backend.forward(batch.query, batch.key, batch.value, cache, batch.metadata, batch.scale)
        worst = max(worst, (got - expected).abs().max().item())
        if not torch.isfinite(got).all():
            return float("inf")
    return worst
