"""Every fast backend agrees with torch_ref on randomized paged batches."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagellm.attention.kv_quant import KVScales
from pagellm.attention.selector import get_attn_backend
from pagellm.attention.synthetic import SyntheticBatch, make_batch
from pagellm.kernels import ops

# The C++ backend is tested wherever it builds; torch_sdpa always.
BACKENDS = ["torch_sdpa"] + (["cpu_paged"] if ops.available() else [])

# (q_len, seq_len) per sequence.
SCENARIOS = {
    "prefill_only": [(13, 13), (40, 40), (1, 1), (16, 16)],
    "decode_only": [(1, 1), (1, 17), (1, 100), (1, 64), (1, 33), (1, 250)],
    "mixed": [(1, 70), (25, 25), (1, 1), (9, 30), (1, 48), (64, 200), (1, 129)],
    "chunked_prefill_cached_prefix": [(32, 96), (7, 50), (16, 64), (100, 260)],
    "single_token_sequences": [(1, 1), (1, 1), (1, 2)],
    "block_multiple_context": [(32, 32), (1, 64), (16, 48), (1, 128)],
    "zero_new_tokens_for_one_seq": [(5, 20), (0, 12), (1, 9)],
}


def run_both(batch: SyntheticBatch, name: str, reference) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ref_cache = batch.kv_cache.clone()
    cache = batch.kv_cache.clone()
    expected = reference.forward(batch.query, batch.key, batch.value, ref_cache, batch.metadata, batch.scale, batch.kv_scales)
    backend = get_attn_backend(name, batch.query.device)
    got = backend.forward(batch.query, batch.key, batch.value, cache, batch.metadata, batch.scale, batch.kv_scales)
    return got, expected, cache, ref_cache


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32)])
def test_agrees_with_reference(name, scenario, block_size, num_heads, num_kv_heads, head_dim, reference) -> None:
    batch = make_batch(SCENARIOS[scenario], num_heads, num_kv_heads, head_dim, block_size, seed=block_size + head_dim)
    got, expected, cache, ref_cache = run_both(batch, name, reference)
    assert got.shape == batch.query.shape
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache, ref_cache, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(12, 1, 64), (16, 2, 128), (8, 8, 256), (10, 2, 80), (10, 5, 64), (18, 2, 32)]
    + [(8, 2, 256), (8, 2, 512), (4, 2, 96), (3, 3, 128), (2, 1, 80)],
)
def test_other_head_shapes(name, num_heads, num_kv_heads, head_dim, reference) -> None:
    # Groups above 8 split into head chunks in the C++ kernel; other head sizes use other templates;
    # a decode item covers up to 4 kv heads (8 and 5 kv heads: items of 4 + 4 and 4 + 1); groups of
    # 1, 2, 4 and 8 keep 4, 4, 2 and 1 sums per head (80 in groups of 2: 10 or 5 vectors, a tail).
    batch = make_batch(SCENARIOS["mixed"], num_heads, num_kv_heads, head_dim, block_size=16, seed=7)
    got, expected, _, _ = run_both(batch, name, reference)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not ops.available(), reason="C++ kernels unavailable")
def test_the_kernel_states_its_head_sizes_and_others_attend_in_torch(reference) -> None:
    """paged_attention.cpp's own list of head sizes; a size outside it goes to torch (and the op refuses it)."""
    assert ops.paged_attention_head_dims() == {32, 64, 80, 96, 128, 256, 512}
    batch = make_batch(SCENARIOS["mixed"], 4, 2, 48, block_size=16, seed=7)
    assert not ops.paged_attention_supports(batch.query, batch.kv_cache)
    got, expected, _, _ = run_both(batch, "cpu_paged", reference)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    m = batch.metadata
    out = torch.empty_like(batch.query)
    with pytest.raises(ValueError, match="unsupported head_dim 48"):
        ops.paged_attention(out, batch.query, batch.kv_cache, m.block_table, m.seq_lens, m.query_start_loc, batch.scale, False)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("seqs", [[(1, 3000), (1, 700)], [(1, 2000), (5, 700)]])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 512)])
def test_long_decode_few_sequences(name, num_threads, seqs, num_heads, num_kv_heads, head_dim, reference) -> None:
    # Few long contexts: the C++ kernel splits the context across threads and merges (512: Gemma 4's
    # full layers, the widest head the merge holds).
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        batch = make_batch(seqs, num_heads, num_kv_heads, head_dim, block_size=16, seed=11)
        got, expected, _, _ = run_both(batch, name, reference)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("seqs", [[(9, 609)], [(9, 700), (1, 40)], [(3, 2000)], [(2, 513), (1, 900)]])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
def test_few_short_prefills_of_long_contexts(name, num_threads, seqs, cache_dtype, reference) -> None:
    # A verification's few tokens after a long context: with two threads the C++ kernel splits
    # each tile's keys into parts and merges their partials (the value scale applied there).
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        batch = make_batch(seqs, 9, 3, 64, 16, seed=17, cache_dtype=cache_dtype, kv_scales=KVScales(1.0, 0.7))
        got, expected, _, _ = run_both(batch, name, reference)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("seqs", [[(1, 100)] * 12, [(1, 90), (1, 300), (20, 120), (1, 40)] * 3, [(1, 1500), (1, 1600)]])
def test_sequences_sharing_prefix_blocks(name, num_threads, seqs, reference) -> None:
    # Prefix caching: sequences' tables point at the same physical blocks for their common prefix
    # (two prefixes here, 2 blocks each); the C++ kernel runs such sequences back to back.
    block_size, shared = 16, 2
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        batch = make_batch(seqs, 9, 3, 64, block_size=block_size, seed=23)
        table = batch.metadata.block_table
        for i in range(2, len(seqs)):
            table[i, :shared] = table[i % 2, :shared]  # only cached positions: new tokens go past them
        got, expected, cache, ref_cache = run_both(batch, name, reference)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache, ref_cache, equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("name", BACKENDS)
def test_query_view_of_fused_projection(name, reference) -> None:
    # Models slice q out of a fused qkv projection: token rows are strided, heads contiguous.
    batch = make_batch(SCENARIOS["mixed"], 9, 3, 64, block_size=16, seed=13)
    num_tokens = batch.query.shape[0]
    fused = torch.cat(
        [batch.query.reshape(num_tokens, -1), batch.key.reshape(num_tokens, -1), batch.value.reshape(num_tokens, -1)], dim=1
    )
    query, key, value = fused.split([9 * 64, 3 * 64, 3 * 64], dim=1)
    query, key, value = query.view(num_tokens, 9, 64), key.view(num_tokens, 3, 64), value.view(num_tokens, 3, 64)
    assert not query.is_contiguous() and not key.is_contiguous()
    strided = SyntheticBatch(query, key, value, batch.kv_cache, batch.metadata, batch.scale)
    got, expected, _, _ = run_both(strided, name, reference)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", BACKENDS)
def test_bfloat16_cache(name, reference) -> None:
    # cpu_paged hands reduced precision to the torch path; results stay close to the float32 oracle.
    batch = make_batch(SCENARIOS["mixed"], 9, 3, 64, block_size=16, seed=17, dtype=torch.bfloat16)
    got, expected, _, _ = run_both(batch, name, reference)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("scenario", ["decode_only", "mixed", "chunked_prefill_cached_prefix"])
@pytest.mark.parametrize("num_threads", [1, 2])
def test_half_precision_cache_float32_queries(name, cache_dtype, scenario, num_threads, reference) -> None:
    # --kv-cache-dtype float16/bfloat16 on a float32 model: keys and values are rounded once, as
    # they enter the cache (as torch's .to() rounds them), and everything else is float32, so a
    # backend agrees with the oracle reading the same cache as closely as with a float32 cache.
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        batch = make_batch(SCENARIOS[scenario], 9, 3, 64, block_size=16, seed=29, cache_dtype=cache_dtype)
        got, expected, cache, ref_cache = run_both(batch, name, reference)
    finally:
        torch.set_num_threads(previous)
    assert got.dtype == torch.float32 and cache.dtype == cache_dtype
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache, ref_cache, equal_nan=True, atol=0, rtol=0)


EIGHT_BIT = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("cache_dtype", EIGHT_BIT)
@pytest.mark.parametrize(
    ("scenario", "num_heads", "num_kv_heads", "head_dim"),
    [
        ("decode_only", 9, 3, 64),
        ("mixed", 9, 3, 64),
        ("chunked_prefill_cached_prefix", 9, 3, 64),
        ("mixed", 16, 2, 128),
        ("mixed", 10, 5, 64),
        ("zero_new_tokens_for_one_seq", 18, 2, 32),
        ("decode_only", 8, 2, 512),
    ],
)
def test_eight_bit_cache(name, cache_dtype, scenario, num_heads, num_kv_heads, head_dim, reference) -> None:
    # Keys and values quantized once, on the way in (kv_quant), under non-unit fp8 scales that the
    # kernels fold into queries and outputs; read back, everything is float32, so a backend agrees
    # with the oracle reading the same bytes as closely as with a float32 cache.
    scales = KVScales(0.05, 0.02) if cache_dtype != torch.int8 else KVScales()
    batch = make_batch(SCENARIOS[scenario], num_heads, num_kv_heads, head_dim, 16, seed=31, cache_dtype=cache_dtype, kv_scales=scales)
    batch.key.mul_(4)  # keys and values of the size the scales are for
    batch.value.mul_(2)
    got, expected, cache, ref_cache = run_both(batch, name, reference)
    assert got.dtype == torch.float32 and cache.dtype == cache_dtype
    # Sharper softmaxes than randn's, so float32's summation order shows a little more.
    torch.testing.assert_close(got, expected, atol=5e-5, rtol=5e-5)
    assert torch.equal(cache.view(torch.uint8), ref_cache.view(torch.uint8))


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("cache_dtype", EIGHT_BIT)
@pytest.mark.parametrize("num_threads", [1, 2])
def test_eight_bit_cache_long_decode_split_and_merged(name, cache_dtype, num_threads, reference) -> None:
    # The C++ kernel splits few long contexts across threads: partials carry the value scale.
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        batch = make_batch([(1, 3000), (1, 700)], 9, 3, 64, 16, seed=5, cache_dtype=cache_dtype, kv_scales=KVScales(0.3, 0.7))
        got, expected, _, _ = run_both(batch, name, reference)
    finally:
        torch.set_num_threads(previous)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not ops.available(), reason="C++ kernels unavailable")
@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_write_kv_cache_rounds_like_torch(cache_dtype) -> None:
    # The C++ scatter narrows float32 rows itself; it must round exactly as .to() does, including
    # ties, values past float16's range (inf), subnormals and NaN.
    gen = torch.Generator().manual_seed(3)
    num_tokens, heads, dim = 40, 3, 64
    key = torch.randn(num_tokens, heads, dim, generator=gen) * torch.logspace(-9, 6, num_tokens)[:, None, None]
    key[0, 0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 70000.0])
    key[1, 0, :3] = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8])  # float16 / bfloat16 ties
    value = -key.flip(0)
    cache = torch.zeros(2, 8, 16, heads, dim, dtype=cache_dtype)
    slots = torch.randperm(8 * 16, generator=gen)[:num_tokens]
    ops.write_kv_cache(cache, key, value, slots)
    flat = cache.view(2, -1, heads, dim)
    torch.testing.assert_close(flat[0, slots], key.to(cache_dtype), equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(flat[1, slots], value.to(cache_dtype), equal_nan=True, atol=0, rtol=0)


@st.composite
def random_batches(draw):
    num_seqs = draw(st.integers(1, 6))
    seqs = []
    for _ in range(num_seqs):
        q_len = draw(st.sampled_from([1, 1, 1, draw(st.integers(1, 80))]))
        prefix = draw(st.integers(0, 150))
        seqs.append((q_len, q_len + prefix))
    num_kv_heads = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 2, 3, 5]))
    return dict(
        seqs=seqs,
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=draw(st.sampled_from([32, 64])),
        block_size=draw(st.sampled_from([8, 16, 32])),
        seed=draw(st.integers(0, 2**16)),
    )


@pytest.mark.parametrize("name", BACKENDS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(spec=random_batches())
def test_random_batches(name, spec, reference) -> None:
    batch = make_batch(**spec)
    got, expected, _, _ = run_both(batch, name, reference)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("q_len", "context_len"), [(17, 17), (9, 40), (1, 33)])
def test_sdpa_and_matmul_prefill_paths_agree(q_len, context_len) -> None:
    # The accelerator path (SDPA) runs here on CPU so that it is covered without a GPU.
    from pagellm.attention.torch_ref import causal_attention
    from pagellm.attention.torch_sdpa import _prefill_matmul, _prefill_sdpa

    gen = torch.Generator().manual_seed(q_len)
    query = torch.randn(q_len, 6, 32, generator=gen)
    keys = torch.randn(context_len, 2, 32, generator=gen)
    values = torch.randn(context_len, 2, 32, generator=gen)
    expected = causal_attention(query, keys, values, 0.2)
    torch.testing.assert_close(_prefill_sdpa(query, keys, values, 0.2), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_prefill_matmul(query, keys, values, 0.2), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", BACKENDS)
def test_peaked_softmax_stays_finite(name, reference) -> None:
    # Scores in the thousands: the online softmax must rescale, not overflow. At that size float32
    # rounding of the scores alone (|s| * 6e-8 * sqrt(D)) moves probabilities by ~1e-4, whatever
    # the summation order, hence the looser tolerance.
    batch = make_batch(SCENARIOS["mixed"], 9, 3, 64, block_size=16, seed=19)
    peaked = SyntheticBatch(batch.query * 300.0, batch.key, batch.value, batch.kv_cache, batch.metadata, batch.scale)
    got, expected, _, _ = run_both(peaked, name, reference)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("name", BACKENDS)
def test_empty_batch(name, reference) -> None:
    batch = make_batch([], 9, 3, 64, block_size=16)
    got, _, _, _ = run_both(batch, name, reference)
    assert got.shape == (0, 9, 64)


@pytest.mark.skipif(not ops.available(), reason="C++ kernels unavailable")
@pytest.mark.parametrize("to_l2", [False, True])
@pytest.mark.parametrize("seqs", [[(1, 700)] * 6, [(1, 3000), (1, 40)], [(1, 33), (4, 50), (1, 17)]])
def test_decode_prefetch_level_does_not_change_results(to_l2: bool, seqs, reference) -> None:
    # The level is the backend's, from the CpuTuning it is given; the kernel keeps no state.
    from pagellm.attention.cpu_paged import CpuPagedBackend
    from pagellm.kernels.tuning import CpuTuning

    backend = CpuPagedBackend(CpuTuning(decode_prefetch_to_l2=to_l2))
    assert backend.decode_prefetch_to_l2 == to_l2
    batch = make_batch(seqs, 9, 3, 64, 16, seed=3)
    cache = batch.kv_cache.clone()
    got = backend.forward(batch.query, batch.key, batch.value, cache, batch.metadata, batch.scale)
    expected = reference.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.metadata, batch.scale)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
