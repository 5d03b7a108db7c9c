"""Layers whose KV rows differ (Gemma 4's wider full layers): one KV tensor per group position whose
token rows are the widest there, a narrower layer's cache a view of the first part of each row
(padded rows), layers reading another's KV handed their source's cache and block table and owning
no blocks, a block costing the widest rows once, and models of one shape laid out as before."""
from __future__ import annotations

import pytest
import torch
from transformers import Gemma4TextConfig

from pagellm.attention.kv_quant import dequantize, write_kv_cache
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.models.shape import ModelShape
from pagellm.plan.kv_cache_plan import kv_cache_layout_for
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams
from pagellm.worker.kv_cache import (
    KVCachePrefaulter,
    allocate_grouped_kv_caches,
    bytes_per_block,
    distinct_cache_tensors,
    grouped_bytes_per_block,
    widest_kv_rows,
)

S, F = "sliding_attention", "full_attention"
BLOCK = 4


def gemma4_shape(**fields) -> ModelShape:
    """The tiny Gemma 4 of tests/models/test_architectures.py: full layers 2 and 5 with 32-wide
    heads, the rest sliding (W=7) with 16-wide ones; layers 4 and 5 read layers 3 and 2's KV."""
    values = dict(
        num_hidden_layers=6, layer_types=[S, S, F, S, S, F], hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, global_head_dim=32, sliding_window=7, num_kv_shared_layers=2, vocab_size=128, architectures=["Gemma4ForCausalLM"],
    )
    return ModelShape.from_hf_config(Gemma4TextConfig(**{**values, **fields}))


def test_gemma4_layers_share_one_tensor_of_the_widest_rows_and_shared_layers_their_sources():
    shape = gemma4_shape()
    assert shape.kv_shared_layers == ((4, 3), (5, 2))
    assert shape.layer_kv_heads == ((2, 16), (2, 16), (2, 32), (2, 16), (2, 16), (2, 32))
    assert (shape.num_kv_heads, shape.head_dim) == (2, 16) and shape.kv_layer_ids == (0, 1, 2, 3)
    layout = kv_cache_layout_for(shape)
    assert [g.layer_ids for g in layout.groups] == [(2,), (0,), (1,), (3,)] and layout.group_size == 1
    assert layout.layer_group_ids == (1, 2, 0, 3, 3, 0)  # the readers use their sources' block tables
    assert widest_kv_rows(layout, shape.layer_kv_heads, torch.float32) == [(2, 32)]
    caches = allocate_grouped_kv_caches(layout, 10, BLOCK, 2, 16, torch.float32, torch.device("cpu"), shape.layer_kv_heads)
    wide = caches[2]
    assert wide.shape == (2, 10, BLOCK, 2, 32) and wide.is_contiguous() and caches[5] is wide
    # The sliding layers: views of the first 32 of each token's 64 elements.
    assert caches[0].shape == (2, 10, BLOCK, 2, 16) and caches[0].stride() == (10 * BLOCK * 64, BLOCK * 64, 64, 16, 1)
    assert all(caches[i].data_ptr() == wide.data_ptr() for i in (0, 1, 3)) and caches[4] is caches[3]
    assert len(distinct_cache_tensors(caches)) == 1 and distinct_cache_tensors(caches)[0] is wide
    # One block: the 32-wide rows only, K and V, 4 tokens, 2 heads, float32 (3,072 bytes before: a 16-wide page too).
    assert grouped_bytes_per_block(layout, shape.layer_kv_heads, BLOCK, torch.float32) == 2 * 4 * 2 * 32 * 4 == 2048
    assert sum(c.nbytes for c in distinct_cache_tensors(caches)) == 10 * 2048
    assert KVCachePrefaulter(caches).total_bytes == KVCachePrefaulter([wide]).total_bytes  # each tensor once, whole


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=str)
def test_a_narrow_layer_writes_the_first_part_of_its_blocks_rows(dtype):
    layout = kv_cache_layout_for(gemma4_shape())
    caches = allocate_grouped_kv_caches(layout, 6, BLOCK, 2, 16, dtype, torch.device("cpu"), gemma4_shape().layer_kv_heads)
    key, value = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    write_kv_cache(key, value, caches[0], torch.tensor([5, 6, 13]))  # block 1's tokens 1 and 2, block 3's token 1
    rows = caches[2].view(2, 6 * BLOCK, -1)  # [K/V, slot, the token's whole row]
    width = caches[0].shape[3] * caches[0].shape[4]  # the narrow layer's row: 2 x 16 (2 x 18 in int8)
    assert rows[:, [5, 6, 13], :width].any() and not rows[:, [5, 6, 13], width:].any()
    assert not rows[:, [0, 1, 2, 3, 4, 7, 8, 9, 10, 11, 12, 14]].any()
    stored = caches[0][0].reshape(6 * BLOCK, 2, -1)[5]  # slot 5's key through the narrow view
    torch.testing.assert_close(dequantize(stored), key[0], atol=0.02, rtol=0.02)


def test_shared_layers_own_no_blocks():
    layout = kv_cache_layout_for(gemma4_shape())
    manager = KVCacheManager(32, BLOCK, 64, enable_caching=False, kv_cache_layout=layout)
    request = Request("a", list(range(10)), SamplingParams(max_tokens=1), 1)
    assert manager.allocate_slots(request, 10) is not None
    tables = manager.get_block_ids_by_group("a")
    # Four groups (layers 2, 0, 1, 3), three blocks each for 10 tokens: twelve blocks, none for layers 4 and 5.
    assert [len(t) for t in tables] == [3, 3, 3, 3] and len({b for t in tables for b in t}) == 12
    assert manager.num_held_blocks("a") == 12


def test_the_widest_row_at_each_position_sizes_its_tensor():
    # 31B-style full layers: one KV head fewer than the sliding layers', twice as wide.
    shape = gemma4_shape(num_kv_shared_layers=0, num_key_value_heads=4, attention_k_eq_v=True, num_global_key_value_heads=2)
    assert shape.layer_kv_heads == ((4, 16), (4, 16), (2, 32), (4, 16), (4, 16), (2, 32))
    layout = kv_cache_layout_for(shape)
    # Groups (2, 5), (0, 3), (1, 4): at each of the two positions a full layer and two sliding ones.
    assert [g.layer_ids for g in layout.groups] == [(2, 5), (0, 3), (1, 4)]
    # 2 x 32 and 4 x 16 are rows of 64 elements: the first (the full layer's) is the tensor's, the
    # sliding layers take a plain view of it; in int8 each head row carries a scale: 4 x 18 is wider.
    assert widest_kv_rows(layout, shape.layer_kv_heads, torch.float16) == [(2, 32), (2, 32)]
    assert widest_kv_rows(layout, shape.layer_kv_heads, torch.int8) == [(4, 16), (4, 16)]
    caches = allocate_grouped_kv_caches(layout, 10, BLOCK, 4, 16, torch.float16, torch.device("cpu"), shape.layer_kv_heads)
    assert caches[0].shape == (2, 10, BLOCK, 4, 16) and caches[0].is_contiguous() and caches[0].data_ptr() == caches[2].data_ptr()
    int8 = allocate_grouped_kv_caches(layout, 10, BLOCK, 4, 16, torch.int8, torch.device("cpu"), shape.layer_kv_heads)
    assert int8[0].is_contiguous() and int8[2].shape == (2, 10, BLOCK, 2, 34) and int8[2].stride(2) == 4 * 18
    per_rank = [(h // 2, d) for h, d in shape.layer_kv_heads]  # two tensor-parallel ranks
    assert grouped_bytes_per_block(layout, per_rank, BLOCK, torch.float16) == 2 * bytes_per_block(1, BLOCK, 1, 32, torch.float16)
    assert grouped_bytes_per_block(layout, per_rank, BLOCK, torch.int8) == 2 * bytes_per_block(1, BLOCK, 2, 16, torch.int8)


def test_models_of_one_shape_keep_one_tensor_per_group_position():
    windows = [7 if (i + 1) % 6 else None for i in range(12)]  # Gemma 3's pattern
    shape = ModelShape(12, 2, 16, 128, layer_sliding_windows=tuple(windows))
    assert shape.layer_kv_heads == ()
    layout = kv_cache_layout_for(shape)
    assert widest_kv_rows(layout, [(2, 16)] * 12, torch.float32) == [(2, 16)] * layout.group_size
    assert grouped_bytes_per_block(layout, [(2, 16)] * 12, BLOCK, torch.float32) == bytes_per_block(
        layout.group_size, BLOCK, 2, 16, torch.float32
    )
    caches = allocate_grouped_kv_caches(layout, 10, BLOCK, 2, 16, torch.float32, torch.device("cpu"))
    assert all(c.is_contiguous() and c.shape == (2, 10, BLOCK, 2, 16) for c in caches)
    ids = layout.layer_tensor_ids  # the tensors themselves, shared as before: no views
    assert all((caches[a] is caches[b]) == (ids[a] == ids[b]) for a in range(12) for b in range(12))


def test_gemma4_e4b_kv_per_token_against_the_per_shape_design_and_every_layer_full():
    """google/gemma-4-E4B's text config: 42 layers (five sliding W=512 to one full), 2 KV heads of
    256 (512 on full layers), the last 18 reading layers 22 (sliding) and 23 (full); bfloat16, block 16."""
    shape = ModelShape.from_hf_config(Gemma4TextConfig(
        num_hidden_layers=42, hidden_size=2560, num_attention_heads=8, num_key_value_heads=2, head_dim=256, global_head_dim=512,
        sliding_window=512, num_kv_shared_layers=18, layer_types=([S] * 5 + [F]) * 7, architectures=["Gemma4ForCausalLM"],
    ))
    layout = kv_cache_layout_for(shape)
    assert layout.groups[0].layer_ids == (5, 11, 17, 23) and layout.num_groups == 6 and layout.group_size == 4
    assert set(dict(shape.kv_shared_layers).values()) == {22, 23}
    block_bytes = grouped_bytes_per_block(layout, shape.layer_kv_heads, 16, torch.bfloat16)
    assert block_bytes == 4 * 65536  # four positions, each a 512-wide row's page
    per_shape_block_bytes = 4 * (65536 + 32768)  # the design before: a 512-wide and a 256-wide page at each position
    every_layer_full = 2 * sum(h * d for h, d in shape.layer_kv_heads) * 2  # bytes per token, bfloat16
    assert every_layer_full == 100352

    def per_token(n: int, bytes_a_block: int) -> int:  # a decoding request (one token a step) of n tokens
        return round(layout.max_blocks_per_request(n, 16, 1) * bytes_a_block / n)

    def ideal(n: int) -> int:  # every group's blocks at its own row width: no padding
        full = -(-n // 16) * 4 * 65536
        sliding = 5 * min(-(-n // 16), -(-(512 - 1 + 1) // 16) + 1) * 4 * 32768
        return round((full + sliding) / n)

    assert [per_token(n, block_bytes) for n in (4096, 32768)] == [26944, 17704]
    assert [per_token(n, per_shape_block_bytes) for n in (4096, 32768)] == [40416, 26556]
    assert [ideal(n) for n in (4096, 32768)] == [21664, 17044]
