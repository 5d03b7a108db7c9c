"""A narrower layer's cache as a view into a wider layer's rows (Gemma 4's sliding layers in its full
layers' tensor; pagellm.worker.kv_cache): every backend writes and attends through the view exactly
as through a contiguous cache of its own, and never touches the rest of a token's row."""
from __future__ import annotations

import pytest
import torch

from pagellm.attention.backend import AttentionOptions
from pagellm.attention.kv_quant import KVScales, narrow_kv_view
from pagellm.attention.selector import get_attn_backend
from pagellm.attention.synthetic import make_batch, pad_rows
from pagellm.kernels import ops

BACKENDS = ["torch_ref", "torch_sdpa"] + (["cpu_paged"] if ops.available() else [])
CACHE_DTYPES = [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8]
SCENARIOS = {
    "decode": [(1, 20), (1, 100), (1, 1), (1, 64), (1, 33)],
    "mixed": [(1, 70), (25, 25), (9, 30), (0, 12), (20, 84), (1, 1)],
}


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("window", [None, 24])
def test_narrow_view_equals_a_cache_of_its_own(name, cache_dtype, scenario, window) -> None:
    # 3 KV heads of 64 inside token rows of 2 heads of 128: 64 padding elements a token.
    scales = KVScales(0.05, 0.02) if cache_dtype.is_floating_point and cache_dtype.itemsize == 1 else KVScales()
    batch = make_batch(SCENARIOS[scenario], 9, 3, 64, 16, seed=3, cache_dtype=cache_dtype, kv_scales=scales)
    own = batch.kv_cache.clone()
    view, wide = pad_rows(batch.kv_cache, 2, 128)
    expected_wide = wide.clone()
    backend = get_attn_backend(name, batch.query.device)
    if name == "cpu_paged":
        assert ops.paged_attention_supports(batch.query, view)  # the kernel, not the torch fallback
    args = (batch.metadata, batch.scale, scales, AttentionOptions(sliding_window=window))
    expected = backend.forward(batch.query, batch.key, batch.value, own, *args)
    got = backend.forward(batch.query, batch.key, batch.value, view, *args)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, atol=0, rtol=0)
    # The new rows landed in the view's part of each token's row; the padding is still poison.
    narrow_kv_view(expected_wide, 3, 64).view(torch.uint8).copy_(own.view(torch.uint8))
    assert torch.equal(wide.view(torch.uint8), expected_wide.view(torch.uint8))


@pytest.mark.skipif(not ops.available(), reason="C++ kernels unavailable")
def test_kernel_refuses_other_strided_caches() -> None:
    batch = make_batch(SCENARIOS["decode"], 9, 3, 64, 16, seed=4)
    every_other_block = batch.kv_cache[:, ::2]
    assert not ops.paged_attention_supports(batch.query, every_other_block)
    out = torch.empty_like(batch.query)
    md = batch.metadata
    with pytest.raises(ValueError, match="contiguous"):
        ops.paged_attention(out, batch.query, every_other_block, md.block_table, md.seq_lens, md.query_start_loc, batch.scale, False)
    with pytest.raises(ValueError, match="contiguous"):
        ops.write_kv_cache(every_other_block, batch.key, batch.value, md.slot_mapping)
