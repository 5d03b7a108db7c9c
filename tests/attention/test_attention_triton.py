"""The Triton backend's kernels against torch_ref, run on CPU in Triton's interpreter.

TRITON_INTERPRET must be set before the kernels are defined (Triton reads it in ``triton.jit``),
so it is set here, at collection, before anything imports them. Shapes stay tiny: the
interpreter runs each program in numpy. Two interpreter limits shape the bf16 checks: it upcasts
bf16 dot products (the backend asks it to), and it truncates float32 -> bfloat16 where a GPU
rounds to nearest, so a bf16 cache written from float32 is compared within one bf16 step. 8-bit
caches are compared byte for byte.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install 'pagellm[gpu]')")

from pagellm.attention.kv_quant import KVScales, narrow_kv_view, row_width, write_kv_cache
from pagellm.attention.synthetic import SyntheticBatch, make_batch, pad_rows
from pagellm.attention.triton_kernels import cache_write as triton_cache_write
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
    expected = reference.forward(batch.query, batch.key, batch.value, ref_cache, batch.metadata, batch.scale, batch.kv_scales)
    got = backend.forward(batch.query, batch.key, batch.value, cache, batch.metadata, batch.scale, batch.kv_scales)
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


# 8-bit caches: fp8 under per-layer scales, int8 under per-row ones. The kernels encode with bit
# arithmetic (see cache_write), so their caches must equal kv_quant's byte for byte.
EIGHT_BIT = [
    pytest.param(torch.float8_e4m3fn, KVScales(0.05, 0.02), id="fp8_e4m3"),
    pytest.param(torch.float8_e5m2, KVScales(0.05, 0.02), id="fp8_e5m2"),
    pytest.param(torch.int8, KVScales(), id="int8"),
]


def assert_same_bytes(cache: torch.Tensor, ref_cache: torch.Tensor) -> None:
    assert cache.dtype == ref_cache.dtype
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))


@pytest.mark.parametrize(("cache_dtype", "kv_scales"), EIGHT_BIT)
@pytest.mark.parametrize("seqs", [DECODE, MIXED], ids=["decode_split_k", "mixed"])
def test_8bit_cache(cache_dtype, kv_scales, seqs, reference) -> None:
    batch = make_batch(seqs, 9, 3, 64, block_size=16, cache_dtype=cache_dtype, kv_scales=kv_scales, seed=10)
    got, expected, cache, ref_cache = run(batch, small_backend(32), reference)
    assert_same_bytes(cache, ref_cache)
    # Both dequantize the same bytes in float32: only the summation order differs (errors ~1e-6).
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"), [(torch.bfloat16, torch.float8_e4m3fn), (torch.float16, torch.int8)], ids=["bf16_fp8", "fp16_int8"]
)
def test_half_precision_model_with_8bit_cache(dtype, cache_dtype, reference) -> None:
    scales = KVScales(0.05, 0.02) if cache_dtype != torch.int8 else KVScales()
    batch = make_batch(MIXED, 9, 3, 64, block_size=16, dtype=dtype, cache_dtype=cache_dtype, kv_scales=scales, seed=11)
    got, expected, cache, ref_cache = run(batch, small_backend(32), reference)
    assert got.dtype == dtype
    assert_same_bytes(cache, ref_cache)
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-2, rtol=2e-2)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8], ids=str)
@pytest.mark.parametrize("seqs", [DECODE, MIXED], ids=["decode_split_k", "mixed"])
def test_narrow_view_of_wider_rows(cache_dtype, seqs, reference) -> None:
    # A narrow layer's cache padded into a wider one's token rows (pagellm.worker.kv_cache): the
    # kernels take the view's strides, write only its part of each row and read the same values.
    batch = make_batch(seqs, 9, 3, 64, block_size=16, cache_dtype=cache_dtype, seed=14)
    ref_cache = batch.kv_cache.clone()
    view, wide = pad_rows(batch.kv_cache, 2, 128)
    padding = wide.view(torch.uint8).clone()
    expected = reference.forward(batch.query, batch.key, batch.value, ref_cache, batch.metadata, batch.scale, batch.kv_scales)
    got = small_backend(32).forward(batch.query, batch.key, batch.value, view, batch.metadata, batch.scale, batch.kv_scales)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert_same_bytes(view.contiguous(), ref_cache)
    # Outside the view's rows every byte is as it was.
    narrow_kv_view(padding.view(cache_dtype), 3, 64).view(torch.uint8).copy_(ref_cache.view(torch.uint8))
    assert torch.equal(wide.view(torch.uint8), padding)


def test_fp8_scales_are_read_from_the_device_tensor(reference) -> None:
    # A CUDA graph replays its pointers: scales set after the first call must reach the kernels
    # through the same tensor, not as launch constants.
    scales = KVScales(0.05, 0.02)
    # Decode with one split: the path test_8bit_cache (split-K and prefill) leaves out.
    batch = make_batch([(1, 20), (1, 40)], 9, 3, 64, block_size=16, cache_dtype=torch.float8_e4m3fn, kv_scales=scales, seed=12)
    backend = small_backend()
    tensor = scales.device_tensor(batch.query.device)
    backend.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), batch.metadata, batch.scale, scales)
    scales.set(0.1, 0.04)
    assert scales.device_tensor(batch.query.device) is tensor
    got, expected, cache, ref_cache = run(batch, backend, reference)
    assert_same_bytes(cache, ref_cache)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def _edge_rows(dtype: torch.dtype, head_dim: int) -> torch.Tensor:
    """Values at every rounding boundary of an 8-bit format, as rows [T, 1, head_dim]."""
    if dtype == torch.int8:
        gen = torch.Generator().manual_seed(13)
        s = 2.0**-4  # a float16 row scale exactly: absmax 127 * s
        ties = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -126.5, 3.49, -3.51]) * s
        rows = [torch.cat([ties, torch.zeros(head_dim - ties.numel())]), torch.zeros(head_dim)]  # an all-zero row: scale 0
        # Scales that underflow float16 and that are clamped to its max, and an ordinary row.
        rows += [torch.full((head_dim,), 1e-9), torch.randn(head_dim, generator=gen) * 1e7, torch.randn(head_dim, generator=gen)]
        return torch.stack(rows)[:, None, :]
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    finite = codes[torch.isfinite(codes)].unique()
    mids = (finite[1:] + finite[:-1]) / 2  # ties go to the even code
    inf = torch.tensor(float("inf"))
    specials = torch.tensor([float("nan"), float("inf"), 1e-30, 1e38, torch.finfo(dtype).max * 1.03])
    values = torch.cat([finite, mids, torch.nextafter(mids, inf), torch.nextafter(mids, -inf), specials])
    values = torch.cat([values, -values])
    values = torch.cat([values, torch.zeros(-values.numel() % head_dim)])
    return values.view(-1, 1, head_dim)


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8])
def test_8bit_write_rounds_to_nearest_even_and_saturates(cache_dtype) -> None:
    rows = _edge_rows(cache_dtype, 64)
    num = rows.shape[0]
    cache = torch.zeros(2, num, 1, 1, row_width(64, cache_dtype), dtype=cache_dtype)
    ref_cache = cache.clone()
    slots = torch.randperm(num, generator=torch.Generator().manual_seed(14))
    write_kv_cache(rows, -rows, ref_cache, slots, KVScales())
    triton_cache_write.write_kv_cache(rows, -rows, cache, slots, KVScales().device_tensor(torch.device("cpu")))
    assert_same_bytes(cache, ref_cache)
