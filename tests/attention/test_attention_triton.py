"""The Triton backend's kernels against torch_ref, run on CPU in Triton's interpreter.

TRITON_INTERPRET must be set before the kernels are defined (Triton reads it in ``triton.jit``),
so it is set here, at collection, before anything imports them. Shapes stay tiny: the
interpreter runs each program in numpy. Two interpreter limits shape the bf16 checks: it upcasts
bf16 dot products (the backend asks it to), and it truncates float32 -> bfloat16 where a GPU
rounds to nearest, so a bf16 cache written from float32 is compared within one bf16 step.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'pagellm[gpu]')")

from pagellm.attention.synthetic import SyntheticBatch, make_batch
from pagellm.attention.triton_paged import TritonPagedBackend, split_plan

pytestmark = pytest.mark.skipif(os.environ["TRITON_INTERPRET"] != "1", reason="needs TRITON_INTERPRET=1 on CPU")

# (q_len, seq_len) per sequence.
DECODE = [(1, 20), (1, 100), (1, 1), (1, 64)]
PREFILL = [(13, 13), (40, 40), (1, 1)]
# Chunked prefill after a prefix hit (q_len < seq_len), decodes, and a sequence with no new token.
MIXED = [(1, 70), (25, 25), (9, 30), (0, 12), (20, 84), (1, 1)]


def small_backend(partition: int = 512) -> TritonPagedBackend:
    # 16-token tiles: contexts of a few dozen tokens already span several tiles.
    return TritonPagedBackend(partition=partition, block_n=16, block_m=16)


def run(batch: SyntheticBatch, backend: TritonPagedBackend, reference) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ref_cache, cache = batch.kv_cache.clone(), batch.kv_cache.clone()
    expected = reference.forward(batch.query, batch.key, batch.value, ref_cache, batch.metadata, batch.scale)
    got = backend.forward(batch.query, batch.key, batch.value, cache, batch.metadata, batch.scale)
    return got, expected, cache, ref_cache


def assert_same_cache(cache: torch.Tensor, ref_cache: torch.Tensor) -> None:
    torch.testing.assert_close(cache, ref_cache, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("seqs", "partition"),
    [(DECODE, 512), (DECODE, 32), (PREFILL, 512), (MIXED, 512)],
    ids=["decode", "decode_split_k", "prefill", "mixed_chunked_prefix"],
)
def test_gqa_9_3_head_dim_64_fp32(seqs, partition, reference) -> None:
    batch = make_batch(seqs, 9, 3, 64, block_size=16, seed=len(seqs))
    longest = max(range(len(seqs)), key=lambda i: seqs[i][1])
    row = batch.metadata.block_table[longest, : -(-seqs[longest][1] // 16)]
    # make_batch scatters each sequence's blocks: the table is not a run of consecutive ids.
    assert (row[1:] - row[:-1] != 1).any()
    got, expected, cache, ref_cache = run(batch, small_backend(partition), reference)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert_same_cache(cache, ref_cache)


def test_split_k_splits_long_contexts() -> None:
    assert split_plan(100, partition=32, block_n=16) == (4, 32)
    assert split_plan(20, partition=512, block_n=64) == (1, 64)
    # Capped splits grow their partitions instead, keeping them whole tiles.
    assert split_plan(10_000, partition=32, block_n=16, max_splits=8) == (8, 1264)


@pytest.mark.parametrize("seqs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_head_dim_128_and_block_size_8(seqs, reference) -> None:
    batch = make_batch(seqs, 4, 2, 128, block_size=8, seed=3)
    got, expected, cache, ref_cache = run(batch, small_backend(32), reference)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert_same_cache(cache, ref_cache)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seqs", [DECODE, MIXED], ids=["decode_split_k", "mixed"])
def test_half_precision_model_and_cache(dtype, seqs, reference) -> None:
    batch = make_batch(seqs, 9, 3, 64, block_size=16, dtype=dtype, seed=5)
    got, expected, cache, ref_cache = run(batch, small_backend(32), reference)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-2, rtol=2e-2)
    assert_same_cache(cache, ref_cache)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_float32_model_with_half_precision_cache(cache_dtype, reference) -> None:
    batch = make_batch(MIXED, 9, 3, 64, block_size=16, cache_dtype=cache_dtype, seed=6)
    got, expected, cache, ref_cache = run(batch, small_backend(32), reference)
    assert got.dtype == torch.float32
    step = 2.0**-7 if cache_dtype == torch.bfloat16 else 0.0  # interpreter truncation, see the module doc
    torch.testing.assert_close(cache.float(), ref_cache.float(), equal_nan=True, atol=0, rtol=step)
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


def test_padding_tokens_write_nothing_and_empty_sequences_give_zeros(reference) -> None:
    # CUDA-graph padding: slot -1 and seq_len 0 for the rows past the real batch.
    batch = make_batch([(1, 20), (1, 40)], 9, 3, 64, block_size=16, seed=8)
    expected = reference.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), batch.metadata, batch.scale)
    meta = batch.metadata
    pad = 2
    meta.slot_mapping = torch.cat([meta.slot_mapping, torch.full((pad,), -1, dtype=torch.int64)])
    meta.seq_lens = torch.cat([meta.seq_lens, torch.zeros(pad, dtype=torch.int32)])
    meta.block_table = torch.cat([meta.block_table, torch.zeros(pad, meta.block_table.shape[1], dtype=torch.int32)])
    meta.query_start_loc = torch.arange(2 + pad + 1, dtype=torch.int32)
    meta.query_start_loc_cpu = list(range(2 + pad + 1))
    meta.seq_lens_cpu = meta.seq_lens_cpu + [1] * pad  # host copies as a capture would see them
    query = torch.cat([batch.query, torch.randn(pad, 9, 64)])
    key, value = (torch.cat([t, torch.randn(pad, 3, 64)]) for t in (batch.key, batch.value))
    cache = batch.kv_cache.clone()
    before = cache.clone()
    got = small_backend(32).forward(query, key, value, cache, meta, batch.scale)
    torch.testing.assert_close(got[:2], expected, atol=1e-5, rtol=1e-5)
    assert (got[2:] == 0).all()
    written = torch.zeros(cache.shape[1] * cache.shape[2], dtype=torch.bool)
    written[meta.slot_mapping[:2]] = True
    untouched = cache.view(2, -1, 3, 64)[:, ~written]
    torch.testing.assert_close(untouched, before.view(2, -1, 3, 64)[:, ~written], equal_nan=True, atol=0, rtol=0)


def test_strided_qkv_views(reference) -> None:
    # The model hands over views into one fused qkv projection.
    batch = make_batch(MIXED, 9, 3, 64, block_size=16, seed=9)
    fused = torch.cat([batch.query.flatten(1), batch.key.flatten(1), batch.value.flatten(1)], dim=1)
    q, k, v = fused.split([9 * 64, 3 * 64, 3 * 64], dim=1)
    q, k, v = q.view(-1, 9, 64), k.view(-1, 3, 64), v.view(-1, 3, 64)
    assert not q.is_contiguous()
    expected = reference.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), batch.metadata, batch.scale)
    got = small_backend().forward(q, k, v, batch.kv_cache.clone(), batch.metadata, batch.scale)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_rejects_cpu_outside_the_interpreter(monkeypatch) -> None:
    batch = make_batch(DECODE, 9, 3, 64, block_size=16)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="runs on CUDA"):
        small_backend().forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata, batch.scale)


@pytest.mark.parametrize("bad", [dict(partition=48), dict(block_n=8), dict(partition=16, block_n=32)])
def test_bad_tile_sizes_raise(bad) -> None:
    with pytest.raises(ValueError):
        TritonPagedBackend(**bad)
