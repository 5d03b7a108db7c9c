"""Per-layer attention options (sliding window, logit soft cap, sinks) in every backend.

Every backend is compared with a dense float64 reference written here from the formulas
transformers implements (checked against transformers' own eager attention when it is installed):
the soft cap ``c * tanh(s / c)`` before the mask, the window ``p - W < j <= p``, the sink one more
logit in each row's softmax whose column is dropped. The reference reads each sequence's whole
context back from a cache written by kv_quant (so an 8-bit cache is compared on the values it
dequantizes to). Batches mix decodes, fresh prefills, chunks after a cached prefix and a sequence
with no new token, with GQA. The poisoned-block tests hold the backends to the KV cache manager's
contract: blocks wholly before a sequence's first window start may have been freed and reused, so
no backend may read them.

Triton runs in its interpreter on small shapes (TRITON_INTERPRET must be set before its kernels
are defined, as test_attention_triton.py explains).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import types

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from pagellm.attention.backend import AttentionBackend, AttentionOptions
from pagellm.attention.kv_quant import FP8_DTYPES, KVScales, dequantize, write_kv_cache
from pagellm.attention.selector import get_attn_backend
from pagellm.attention.synthetic import SyntheticBatch, make_batch
from pagellm.kernels import ops

CPU_BACKENDS = ["torch_ref", "torch_sdpa"] + (["cpu_paged"] if ops.available() else [])
HAS_TRITON = importlib.util.find_spec("triton") is not None and os.environ["TRITON_INTERPRET"] == "1"
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton, run in its interpreter (TRITON_INTERPRET=1)")
ALL_BACKENDS = CPU_BACKENDS + [pytest.param("triton_paged", marks=needs_triton)]

BLOCK = 8
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 32
# (q_len, seq_len) per sequence: decodes, a fresh prefill, chunks after a cached prefix (one
# spanning two of the C++ kernel's prefill tiles), a sequence with no new token, tiny contexts.
MIXED = [(1, 70), (25, 25), (9, 30), (0, 12), (40, 120), (1, 1), (1, 33), (3, 3)]
# Smaller batches for Triton's interpreter: the same kinds of sequence.
TRITON_MIXED = [(1, 40), (12, 12), (5, 37), (0, 9), (1, 1), (20, 52)]
TRITON_DECODES = [(1, 70), (1, 9), (1, 33)]
CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]

CASES: dict[str, dict] = {
    "window_1": dict(sliding_window=1),
    "window_5": dict(sliding_window=5),
    "window_block": dict(sliding_window=BLOCK),
    "window_3_blocks_plus_1": dict(sliding_window=3 * BLOCK + 1),
    "window_past_context": dict(sliding_window=10_000),
    "window_past_int32": dict(sliding_window=2**40),  # kernels take int32 windows: clamped
    "soft_cap": dict(logits_soft_cap=3.0),
    "sinks": dict(sinks=True),
    "window_5_sinks": dict(sliding_window=5, sinks=True),  # gpt-oss's sliding layers
    "window_50_sinks": dict(sliding_window=50, sinks=True),
    "window_3_blocks_plus_1_soft_cap": dict(sliding_window=3 * BLOCK + 1, logits_soft_cap=3.0),  # Gemma 2
    "all": dict(sliding_window=3 * BLOCK + 1, logits_soft_cap=3.0, sinks=True),
}


def make_options(case: str | dict, num_heads: int = NUM_HEADS, seed: int = 0) -> AttentionOptions:
    """The options of a case in CASES (or of such a dict), with random sinks if it has any."""
    spec = dict(CASES[case] if isinstance(case, str) else case)
    if spec.pop("sinks", False):
        sinks = torch.randn(num_heads, generator=torch.Generator().manual_seed(seed)) * 2
        sinks[0] = 6.0  # above most scores: this head's softmax max is its sink
        spec["sinks"] = sinks
    return AttentionOptions(**spec)


def build(
    seqs: list[tuple[int, int]],
    num_heads: int = NUM_HEADS,
    num_kv_heads: int = NUM_KV_HEADS,
    head_dim: int = HEAD_DIM,
    block_size: int = BLOCK,
    cache_dtype: torch.dtype | None = None,
    seed: int = 0,
) -> SyntheticBatch:
    scales = KVScales(0.05, 0.02) if cache_dtype in FP8_DTYPES else KVScales()
    batch = make_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, cache_dtype=cache_dtype, kv_scales=scales, seed=seed)
    batch.query.mul_(2.0)  # scores of a few units, so that a cap of 3 bends them
    return batch


def written_cache(batch: SyntheticBatch) -> torch.Tensor:
    """The batch's cache after this step's keys and values are written (by kv_quant, the torch path)."""
    cache = batch.kv_cache.clone()
    write_kv_cache(batch.key, batch.value, cache, batch.metadata.slot_mapping, batch.kv_scales)
    return cache


def context(cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int, scales: KVScales) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 keys and values [seq_len, kv_heads, head_dim] of one sequence, as ``cache`` holds them."""
    block_size = cache.shape[2]
    pos = torch.arange(seq_len)
    slots = block_ids.long()[pos // block_size] * block_size + pos % block_size
    flat = cache.view(2, -1, *cache.shape[3:])
    # float8 has no indexing kernels; its bytes index the same.
    rows = flat.view(torch.uint8)[:, slots].view(cache.dtype) if cache.element_size() == 1 else flat[:, slots]
    return dequantize(rows[0], scales.k_scale).double(), dequantize(rows[1], scales.v_scale).double()


def dense_reference(batch: SyntheticBatch, cache: torch.Tensor, options: AttentionOptions | None) -> torch.Tensor:
    """Float64 attention of every new token over its sequence's context: full K/V, explicit mask."""
    options = options or AttentionOptions()
    meta = batch.metadata
    group = batch.query.shape[1] // cache.shape[3]
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    starts = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        keys, values = context(cache, meta.block_table[i], seq_len, batch.kv_scales)
        k, v = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", batch.query[start:end].double(), k) * batch.scale
        if options.logits_soft_cap is not None:
            cap = options.logits_soft_cap
            s = cap * torch.tanh(s / cap)
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        visible = k_pos <= q_pos
        if options.sliding_window is not None:
            visible &= k_pos > q_pos - options.sliding_window
        s = s.masked_fill(~visible, float("-inf"))
        m = s.amax(-1, keepdim=True)
        if options.sinks is not None:
            sink = options.sinks.double()[:, None, None].expand(-1, q_len, 1)
            m = torch.maximum(m, sink)
        weights = torch.exp(s - m)
        denominator = weights.sum(-1, keepdim=True)
        if options.sinks is not None:
            denominator = denominator + torch.exp(sink - m)
        out[start:end] = torch.einsum("hqk,khd->qhd", weights / denominator, v)
    return out


def backend_for(name: str, partition: int = 32) -> AttentionBackend:
    if name == "triton_paged":
        from pagellm.attention.triton_paged import TritonPagedBackend

        # 16-token tiles and small partitions: short contexts already span tiles and splits.
        return TritonPagedBackend(partition=partition, block_n=16, block_m=16)
    return get_attn_backend(name, "cpu")


def run(name: str, batch: SyntheticBatch, options: AttentionOptions | None, cache: torch.Tensor | None = None, metadata=None):
    cache = batch.kv_cache.clone() if cache is None else cache
    return backend_for(name).forward(
        batch.query, batch.key, batch.value, cache, metadata or batch.metadata, batch.scale, batch.kv_scales, options
    )


def assert_matches(got: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5) -> None:
    assert got.dtype == torch.float32
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_options_match_dense_reference(name: str, case: str) -> None:
    batch = build(MIXED, seed=1)
    options = make_options(case)
    cache = written_cache(batch)
    expected = dense_reference(batch, cache, options)
    plain = dense_reference(batch, cache, None)
    if case in ("window_past_context", "window_past_int32"):
        torch.testing.assert_close(expected, plain, atol=1e-12, rtol=0)
    else:  # the option changes the answer, so agreeing with the reference means something
        assert (expected - plain).abs().max() > 1e-2
    assert_matches(run(name, batch, options), expected)


LONG_DECODE_CASES = {
    "window_5": dict(sliding_window=5),
    "window_3_blocks_plus_1": dict(sliding_window=3 * BLOCK + 1),
    "window_600_sinks": dict(sliding_window=600, sinks=True),
    "window_600_soft_cap": dict(sliding_window=600, logits_soft_cap=3.0),
    "sinks_soft_cap": dict(sinks=True, logits_soft_cap=3.0),
}


# (q_len, seq_len) per sequence, and the batch's seed. Few long decodes: with two threads the C++
# kernel splits a window of 600 (or a whole context) across partitions and merges them. A
# verification's 9 tokens after 700: it splits the tiles' keys (a window of 600 is still 608 keys).
# The sink joins at the merge in both.
FEW_LONG_CONTEXTS = {"decodes": ([(1, 3000), (1, 700)], 2), "short_prefill": ([(9, 700), (1, 60)], 6)}


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("case", LONG_DECODE_CASES)
@pytest.mark.parametrize("seqs", FEW_LONG_CONTEXTS)
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_few_long_contexts(name: str, seqs: str, case: str, num_threads: int) -> None:
    options = make_options(LONG_DECODE_CASES[case], 9)
    batch_seqs, seed = FEW_LONG_CONTEXTS[seqs]
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        batch = build(batch_seqs, 9, 3, 64, block_size=16, seed=seed)
        got = run(name, batch, options)
    finally:
        torch.set_num_threads(previous)
    assert_matches(got, dense_reference(batch, written_cache(batch), options))


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("case", ["all", "window_5_sinks"])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_every_cache_dtype(name: str, case: str, cache_dtype: torch.dtype) -> None:
    batch = build(MIXED, cache_dtype=cache_dtype, seed=3)
    options = make_options(case)
    cache = written_cache(batch)
    got = run(name, batch, options)
    # Against the values the cache dequantizes to, everything is float32: as close as float32 caches.
    assert_matches(got, dense_reference(batch, cache, options), tol=2e-5)


@pytest.mark.parametrize("case", ["all", "window_5_sinks", "window_block"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(18, 2, 32), (10, 5, 64), (8, 8, 128)])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_other_head_shapes(name: str, num_heads: int, num_kv_heads: int, head_dim: int, case: str) -> None:
    # Groups of 9 split into head chunks of 8 + 1 in the C++ kernel (sinks indexed per chunk); 5
    # kv heads make decode items of 4 + 1 heads.
    batch = build(MIXED, num_heads, num_kv_heads, head_dim, block_size=16, seed=4)
    options = make_options(case, num_heads)
    assert_matches(run(name, batch, options), dense_reference(batch, written_cache(batch), options))


@pytest.mark.parametrize("name", ALL_BACKENDS)
def test_half_precision_sinks(name: str) -> None:
    # A model's bfloat16 sinks parameter is taken as the float32 values it holds.
    batch = build(TRITON_MIXED, seed=13)
    options = make_options("window_5_sinks")
    options = AttentionOptions(sliding_window=5, sinks=options.sinks.to(torch.bfloat16))
    assert_matches(run(name, batch, options), dense_reference(batch, written_cache(batch), options))


@pytest.mark.parametrize(("q_len", "seq_len", "window"), [(17, 17, 5), (9, 40, 8), (30, 90, 25), (12, 20, 1000)])
def test_sdpa_prefill_path_with_a_window(q_len: int, seq_len: int, window: int) -> None:
    # torch_sdpa's accelerator path (SDPA, the window one more mask over the keys from the first
    # window start on), run here on CPU so that it is covered without a GPU.
    from pagellm.attention.torch_sdpa import _prefill_sdpa

    batch = build([(q_len, seq_len)], seed=12)
    cache = written_cache(batch)
    options = AttentionOptions(sliding_window=window)
    keys, values = context(cache, batch.metadata.block_table[0], seq_len, batch.kv_scales)
    first = max(0, seq_len - q_len - window + 1)
    got = _prefill_sdpa(batch.query, keys[first:].float(), values[first:].float(), batch.scale, options, first)
    assert_matches(got, dense_reference(batch, cache, options))


# Long contexts whose early blocks lie wholly before every new token's window.
POISON_SEQS = [(1, 200), (40, 300), (1, 77), (16, 16), (5, 61)]


def poison(rows: torch.Tensor) -> None:
    """Fills cache rows with each format's NaN (for int8: NaN row scales)."""
    if rows.element_size() == 1:
        rows.view(torch.uint8).fill_(0x7F)  # NaN in e4m3fn and e5m2; int8 127 under a float16 NaN scale
    else:
        rows.fill_(float("nan"))


def poisoned(batch: SyntheticBatch, window: int, how: str) -> tuple[torch.Tensor, object]:
    """The batch's cache and metadata as the cache manager may leave them once it frees the blocks
    wholly before each sequence's first window start: ``table`` points their entries at a NaN block;
    ``fill`` fills them with NaN in place, and also the rows before the window in the block it
    starts in (stricter than the contract: no backend reads those either)."""
    cache = batch.kv_cache.clone()
    table = batch.metadata.block_table.clone()
    block_size = cache.shape[2]
    used = {int(b) for i, seq_len in enumerate(batch.metadata.seq_lens_cpu) for b in table[i, : -(-seq_len // block_size)]}
    spare = min(set(range(cache.shape[1])) - used)
    poison(cache[:, spare])
    freed = 0
    for i, seq_len in enumerate(batch.metadata.seq_lens_cpu):
        q_len = batch.metadata.query_start_loc_cpu[i + 1] - batch.metadata.query_start_loc_cpu[i]
        first = max(0, seq_len - q_len - window + 1)
        for b in range(first // block_size):
            freed += 1
            if how == "table":
                table[i, b] = spare
            else:
                poison(cache[:, table[i, b]])
        if how == "fill" and first % block_size:
            poison(cache[:, table[i, first // block_size], : first % block_size])
    assert freed > 0
    return cache, dataclasses.replace(batch.metadata, block_table=table)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8], ids=str)
@pytest.mark.parametrize("how", ["table", "fill"])
@pytest.mark.parametrize("case", ["window_5_sinks", "all"])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_blocks_before_the_window_are_never_read(name: str, case: str, how: str, cache_dtype: torch.dtype) -> None:
    batch = build(POISON_SEQS, cache_dtype=cache_dtype, seed=6)
    options = make_options(case)
    expected = dense_reference(batch, written_cache(batch), options)
    cache, metadata = poisoned(batch, options.sliding_window, how)
    assert_matches(run(name, batch, options, cache, metadata), expected, tol=2e-5)


@pytest.mark.parametrize("name", ALL_BACKENDS)
def test_default_options_are_no_options(name: str) -> None:
    batch = build(TRITON_MIXED if name == "triton_paged" else MIXED, seed=5)
    plain = run(name, batch, None)
    assert torch.equal(run(name, batch, AttentionOptions()), plain)
    assert torch.equal(run(name, batch, AttentionOptions(sliding_window=None, logits_soft_cap=None, sinks=None)), plain)


BAD_OPTIONS = [
    pytest.param(dict(sliding_window=0), "sliding_window", id="window_0"),
    pytest.param(dict(sliding_window=-4), "sliding_window", id="window_negative"),
    pytest.param(dict(sliding_window=2.5), "sliding_window", id="window_float"),
    pytest.param(dict(sliding_window=True), "sliding_window", id="window_bool"),
    pytest.param(dict(logits_soft_cap=0.0), "logits_soft_cap", id="cap_0"),
    pytest.param(dict(logits_soft_cap=-30.0), "logits_soft_cap", id="cap_negative"),
    pytest.param(dict(logits_soft_cap=float("inf")), "logits_soft_cap", id="cap_inf"),
    pytest.param(dict(logits_soft_cap=float("nan")), "logits_soft_cap", id="cap_nan"),
    pytest.param(dict(sinks=torch.zeros(NUM_HEADS + 1)), "one value per query head", id="sinks_too_many"),
    pytest.param(dict(sinks=torch.zeros(NUM_HEADS, 1)), "one value per query head", id="sinks_2d"),
    pytest.param(dict(sinks=torch.zeros(NUM_HEADS, dtype=torch.int64)), "float tensor", id="sinks_int"),
    pytest.param(dict(sinks=[0.0] * NUM_HEADS), "float tensor", id="sinks_list"),
    pytest.param(dict(sinks=torch.zeros(NUM_HEADS, device="meta")), "device", id="sinks_other_device"),
]


@pytest.mark.parametrize(("spec", "match"), BAD_OPTIONS)
@pytest.mark.parametrize("name", ALL_BACKENDS)
def test_bad_options_raise_before_anything_is_written(name: str, spec: dict, match: str) -> None:
    batch = build([(3, 10), (1, 5)])
    cache = batch.kv_cache.clone()
    with pytest.raises(ValueError, match=match):
        run(name, batch, AttentionOptions(**spec), cache)
    torch.testing.assert_close(cache, batch.kv_cache, equal_nan=True, atol=0, rtol=0)


def test_dense_reference_is_transformers_eager_attention() -> None:
    # The formulas above, checked against the code they come from: gpt-oss's eager attention (sinks)
    # and Gemma 2's (soft cap), under transformers' own sliding-window causal mask.
    masking = pytest.importorskip("transformers.masking_utils")
    gpt_oss = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
    q_len, seq_len, window, cap = 12, 40, 7, 3.0
    batch = build([(q_len, seq_len)], seed=8)
    cache = written_cache(batch)
    keys, values = context(cache, batch.metadata.block_table[0], seq_len, batch.kv_scales)
    q_idx = torch.arange(seq_len - q_len, seq_len)[:, None]
    kv_idx = torch.arange(seq_len)[None, :]
    allowed = masking.sliding_window_causal_mask_function(window)(0, 0, q_idx, kv_idx)
    mask = torch.zeros(q_len, seq_len, dtype=torch.float64).masked_fill(~allowed, float("-inf"))[None, None]
    query = batch.query.double().transpose(0, 1)[None]  # [1, H, q, D]
    k, v = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]
    options = make_options("sinks")
    module = types.SimpleNamespace(num_key_value_groups=NUM_HEADS // NUM_KV_HEADS, sinks=options.sinks.double(), training=False)
    theirs, _ = gpt_oss.eager_attention_forward(module, query, k, v, mask, scaling=batch.scale)
    ours = dense_reference(batch, cache, AttentionOptions(sliding_window=window, sinks=options.sinks))
    torch.testing.assert_close(ours, theirs[0], atol=1e-12, rtol=1e-12)
    theirs, _ = gemma2.eager_attention_forward(module, query, k, v, mask, scaling=batch.scale, softcap=cap)
    ours = dense_reference(batch, cache, AttentionOptions(sliding_window=window, logits_soft_cap=cap))
    torch.testing.assert_close(ours, theirs[0], atol=1e-6, rtol=1e-6)  # Gemma 2 takes its softmax in float32


# --- Triton, in its interpreter: the small batches ---------------------------------------------


@needs_triton
@pytest.mark.parametrize("case", ["window_1", "soft_cap", "sinks", "all", "window_50_sinks", "window_past_int32"])
@pytest.mark.parametrize("seqs", [TRITON_MIXED, TRITON_DECODES], ids=["mixed", "decode_split_k"])
def test_triton_options(seqs: list[tuple[int, int]], case: str) -> None:
    # Decodes alone take the split-K kernel: partitions of 32 split a window of 50 (or a whole
    # context of 70) in two or three, the sink joining through the first split.
    batch = build(seqs, seed=9)
    options = make_options(case)
    assert_matches(run("triton_paged", batch, options), dense_reference(batch, written_cache(batch), options))


@needs_triton
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8], ids=str)
@pytest.mark.parametrize("seqs", [TRITON_MIXED, TRITON_DECODES], ids=["mixed", "decode_split_k"])
def test_triton_cache_dtypes(seqs: list[tuple[int, int]], cache_dtype: torch.dtype) -> None:
    batch = build(seqs, cache_dtype=cache_dtype, seed=10)
    options = make_options("window_50_sinks" if seqs is TRITON_DECODES else "all")
    cache = batch.kv_cache.clone()
    got = run("triton_paged", batch, options, cache)
    # The reference reads the cache the kernel wrote (its bytes equal kv_quant's: test_attention_triton.py).
    assert_matches(got, dense_reference(batch, cache, options), tol=2e-5)


@needs_triton
@pytest.mark.parametrize("how", ["table", "fill"])
@pytest.mark.parametrize("seqs", [[(1, 100), (20, 90), (3, 3)], [(1, 100), (1, 61)]], ids=["mixed", "decode"])
def test_triton_blocks_before_the_window_are_never_read(seqs: list[tuple[int, int]], how: str) -> None:
    batch = build(seqs, seed=11)
    options = make_options("window_5_sinks")
    expected = dense_reference(batch, written_cache(batch), options)
    cache, metadata = poisoned(batch, options.sliding_window, how)
    assert_matches(run("triton_paged", batch, options, cache, metadata), expected)
