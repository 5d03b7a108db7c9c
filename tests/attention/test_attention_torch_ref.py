"""The reference backend against an independent float64 per-query computation, and KV writes."""
from __future__ import annotations

import dataclasses
import math

import torch

from pagellm.attention.kv_quant import write_kv_cache
from pagellm.attention.synthetic import make_batch
from pagellm.attention.torch_ref import TorchReferenceBackend


def naive_attention(batch) -> torch.Tensor:
    """Scalar-loop definition in float64: slot by slot through the block table."""
    meta = batch.metadata
    cache = batch.kv_cache.double()
    block_size = cache.shape[2]
    num_heads = batch.query.shape[1]
    group = num_heads // cache.shape[3]
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        for t in range(start, end):
            pos = seq_len - (end - start) + (t - start)
            for h in range(num_heads):
                q = batch.query[t, h].double()
                scores, values = [], []
                for k_pos in range(pos + 1):
                    block = int(meta.block_table[i, k_pos // block_size])
                    k = cache[0, block, k_pos % block_size, h // group]
                    scores.append(float(q @ k) * batch.scale)
                    values.append(cache[1, block, k_pos % block_size, h // group])
                peak = max(scores)
                weights = [math.exp(s - peak) for s in scores]
                total = sum(weights)
                out[t, h] = sum(w / total * v for w, v in zip(weights, values))
    return out


def test_reference_matches_naive_definition() -> None:
    # Prefill from scratch, chunk after a cached prefix, decodes, a one-token context.
    seqs = [(5, 5), (3, 11), (1, 9), (1, 1), (2, 8)]
    batch = make_batch(seqs, num_heads=6, num_kv_heads=2, head_dim=8, block_size=4, seed=3)
    expected_cache = batch.kv_cache.clone()
    write_kv_cache(batch.key, batch.value, expected_cache, batch.metadata.slot_mapping)
    expected = naive_attention(dataclasses.replace(batch, kv_cache=expected_cache))
    got = TorchReferenceBackend().forward(
        batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata, batch.scale
    )
    torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)


def test_kv_cache_slots_are_written() -> None:
    seqs = [(4, 10), (1, 17), (7, 7)]
    batch = make_batch(seqs, num_heads=4, num_kv_heads=2, head_dim=16, block_size=8, seed=5)
    before = batch.kv_cache.clone()
    TorchReferenceBackend().forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata, batch.scale)
    block_size = batch.kv_cache.shape[2]
    meta = batch.metadata
    written = set()
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        for t in range(start, end):
            pos = seq_len - (end - start) + (t - start)
            block = int(meta.block_table[i, pos // block_size])
            offset = pos % block_size
            assert int(meta.slot_mapping[t]) == block * block_size + offset
            assert torch.equal(batch.kv_cache[0, block, offset], batch.key[t])
            assert torch.equal(batch.kv_cache[1, block, offset], batch.value[t])
            written.add((block, offset))
    # Every other slot is untouched (NaN where unused, the cached prefix elsewhere).
    mask = torch.ones(batch.kv_cache.shape[1:3], dtype=torch.bool)
    for block, offset in written:
        mask[block, offset] = False
    assert torch.equal(batch.kv_cache[:, mask].isnan(), before[:, mask].isnan())
    torch.testing.assert_close(batch.kv_cache[:, mask], before[:, mask], equal_nan=True, atol=0, rtol=0)
