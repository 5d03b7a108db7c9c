"""Layers whose KV rows differ (Gemma 4's wider full layers): a KV tensor per shape at each group
position, layers reading another's KV handed their source's tensor and block table and owning no
blocks, the block's bytes summed over the tensors, and models of one shape laid out as before."""
from __future__ import annotations

import torch
from transformers import Gemma4TextConfig

from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.models.shape import ModelShape
from pagellm.plan.kv_cache_plan import kv_cache_layout_for
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams
from pagellm.worker.kv_cache import allocate_grouped_kv_caches, bytes_per_block, grouped_bytes_per_block, grouped_kv_tensors

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


def test_gemma4_layers_get_a_tensor_per_shape_and_shared_layers_their_sources():
    shape = gemma4_shape()
    assert shape.kv_shared_layers == ((4, 3), (5, 2))
    assert shape.layer_kv_heads == ((2, 16), (2, 16), (2, 32), (2, 16), (2, 16), (2, 32))
    assert (shape.num_kv_heads, shape.head_dim) == (2, 16) and shape.kv_layer_ids == (0, 1, 2, 3)
    layout = kv_cache_layout_for(shape)
    assert [g.layer_ids for g in layout.groups] == [(2,), (0,), (1,), (3,)] and layout.group_size == 1
    assert layout.layer_group_ids == (1, 2, 0, 3, 3, 0)  # the readers use their sources' block tables
    shapes, tensor_ids = grouped_kv_tensors(layout, shape.layer_kv_heads)
    assert shapes == [(2, 32), (2, 16)] and tensor_ids == [1, 1, 0, 1, 1, 0]
    caches = allocate_grouped_kv_caches(layout, 10, BLOCK, 2, 16, torch.float32, torch.device("cpu"), shape.layer_kv_heads)
    assert caches[2].shape == (2, 10, BLOCK, 2, 32) and caches[0].shape == (2, 10, BLOCK, 2, 16)
    assert caches[5] is caches[2] and caches[4] is caches[3] is caches[1] is caches[0]
    assert all(c.is_contiguous() for c in caches)
    # One block: a 32-wide and a 16-wide page, K and V, 4 tokens, 2 heads, float32.
    assert grouped_bytes_per_block(layout, shape.layer_kv_heads, BLOCK, torch.float32) == 2 * 4 * 2 * (32 + 16) * 4 == 3072
    distinct = {id(c): c for c in caches}.values()
    assert sum(c.nbytes for c in distinct) == 10 * 3072


def test_shared_layers_own_no_blocks():
    layout = kv_cache_layout_for(gemma4_shape())
    manager = KVCacheManager(32, BLOCK, 64, enable_caching=False, kv_cache_layout=layout)
    request = Request("a", list(range(10)), SamplingParams(max_tokens=1), 1)
    assert manager.allocate_slots(request, 10) is not None
    tables = manager.get_block_ids_by_group("a")
    # Four groups (layers 2, 0, 1, 3), three blocks each for 10 tokens: twelve blocks, none for layers 4 and 5.
    assert [len(t) for t in tables] == [3, 3, 3, 3] and len({b for t in tables for b in t}) == 12
    assert manager.num_held_blocks("a") == 12


def test_kv_heads_per_layer_kind_size_their_own_tensors():
    # 31B-style full layers: one KV head fewer than the sliding layers', twice as wide.
    shape = gemma4_shape(num_kv_shared_layers=0, num_key_value_heads=4, attention_k_eq_v=True, num_global_key_value_heads=2)
    assert shape.layer_kv_heads == ((4, 16), (4, 16), (2, 32), (4, 16), (4, 16), (2, 32))
    layout = kv_cache_layout_for(shape)
    shapes, _ = grouped_kv_tensors(layout, shape.layer_kv_heads)
    # Groups (2, 5), (0, 3), (1, 4): at each of the two positions a full layer's tensor and a sliding one's.
    assert [g.layer_ids for g in layout.groups] == [(2, 5), (0, 3), (1, 4)]
    assert shapes == [(2, 32), (4, 16), (2, 32), (4, 16)]
    per_rank = [(h // 2, d) for h, d in shape.layer_kv_heads]  # two tensor-parallel ranks
    assert grouped_bytes_per_block(layout, per_rank, BLOCK, torch.float16) == sum(
        bytes_per_block(1, BLOCK, h // 2, d, torch.float16) for h, d in shapes
    )


def test_models_of_one_shape_keep_one_tensor_per_group_position():
    windows = [7 if (i + 1) % 6 else None for i in range(12)]  # Gemma 3's pattern
    shape = ModelShape(12, 2, 16, 128, layer_sliding_windows=tuple(windows))
    assert shape.layer_kv_heads == ()
    layout = kv_cache_layout_for(shape)
    shapes, tensor_ids = grouped_kv_tensors(layout, [(2, 16)] * 12)
    assert shapes == [(2, 16)] * layout.group_size and tuple(tensor_ids) == layout.layer_tensor_ids
    assert grouped_bytes_per_block(layout, [(2, 16)] * 12, BLOCK, torch.float32) == bytes_per_block(
        layout.group_size, BLOCK, 2, 16, torch.float32
    )


def test_gemma4_e4b_kv_per_token_against_every_layer_full():
    """google/gemma-4-E4B's text config: 42 layers (five sliding W=512 to one full), 2 KV heads of
    256 (512 on full layers), the last 18 reading layers 22 (sliding) and 23 (full)."""
    shape = ModelShape.from_hf_config(Gemma4TextConfig(
        num_hidden_layers=42, hidden_size=2560, num_attention_heads=8, num_key_value_heads=2, head_dim=256, global_head_dim=512,
        sliding_window=512, num_kv_shared_layers=18, layer_types=([S] * 5 + [F]) * 7, architectures=["Gemma4ForCausalLM"],
    ))
    layout = kv_cache_layout_for(shape)
    assert layout.groups[0].layer_ids == (5, 11, 17, 23) and layout.num_groups == 6 and layout.group_size == 4
    assert set(dict(shape.kv_shared_layers).values()) == {22, 23}
    block_bytes = grouped_bytes_per_block(layout, shape.layer_kv_heads, 16, torch.bfloat16)
    assert block_bytes == 4 * (65536 + 32768)  # four positions, each a 512-wide and a 256-wide page
    every_layer_full = 2 * sum(h * d for h, d in shape.layer_kv_heads) * 2  # bytes per token, bfloat16
    assert every_layer_full == 100352
    # A decoding request (one token a step) at 4,096 and 32,768 tokens.
    per_token = {n: layout.max_blocks_per_request(n, 16, 1) * block_bytes / n for n in (4096, 32768)}
    assert round(per_token[4096]) == 40416 and round(per_token[32768]) == 26556
