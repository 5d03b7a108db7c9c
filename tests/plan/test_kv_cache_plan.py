"""The KV cache plan of a hybrid model: state slots carved from the same budget as the blocks."""
from __future__ import annotations

import pytest
import torch

import pagellm.bench.baseline.contiguous_kv_cache_manager  # noqa: F401  (registers "contiguous")
from pagellm.config import EngineConfig
from pagellm.models.shape import ModelShape, StateTensorShape
from pagellm.plan.kv_cache_plan import kv_cache_layout_for, plan_kv_cache

# Qwen3.5-2B's shape: 18 Gated DeltaNet layers (a [3, 6144] convolution tail in the activations'
# dtype and a [16, 128, 128] matrix each, float32 unless --mamba-ssm-cache-dtype), 6 attention layers with 2 KV heads of 256.
SHAPE = ModelShape(
    num_layers=24, num_kv_heads=2, head_dim=256, vocab_size=49152,
    state_layer_ids=tuple(i for i in range(24) if i % 4 != 3),
    state_tensors=(StateTensorShape((3, 6144), 1, ssm=False), StateTensorShape((16, 128, 128), 0, ssm=True)),
)
SLOT_BYTES = 18 * (3 * 6144 * 2 + 16 * 128 * 128 * 4)
BLOCK_BYTES = 2 * 6 * 16 * 2 * 256 * 2


def _plan(**kw):
    config = EngineConfig(max_model_len=4096, **kw)
    return plan_kv_cache(config, SHAPE, torch.bfloat16, 4096, kv_cache_layout_for(SHAPE), conv_state_dtype=torch.bfloat16)


def test_slots_for_twice_the_batch_within_three_quarters_of_the_budget():
    plan = _plan(kv_cache_memory_bytes=2 << 30, max_num_seqs=64)
    assert plan.state_slot_bytes == SLOT_BYTES and plan.block_bytes == BLOCK_BYTES
    assert plan.num_state_slots == (2 << 30) * 3 // 4 // SLOT_BYTES  # 128 wanted, 79 fit
    assert plan.num_blocks == ((2 << 30) - plan.num_state_slots * SLOT_BYTES) // BLOCK_BYTES
    assert plan.num_bytes <= 2 << 30
    small = _plan(kv_cache_memory_bytes=2 << 30, max_num_seqs=8)
    assert small.num_state_slots == 16
    assert _plan(kv_cache_memory_bytes=2 << 30, max_num_seqs=8, enable_prefix_caching=False).num_state_slots == 8


def test_a_bfloat16_ssm_state_halves_the_matrices_and_buys_slots():
    budget = 1 << 30
    config = EngineConfig(max_model_len=4096, kv_cache_memory_bytes=budget, max_num_seqs=64)
    wide = plan_kv_cache(config, SHAPE, torch.bfloat16, 4096, kv_cache_layout_for(SHAPE), conv_state_dtype=torch.bfloat16)
    narrow = plan_kv_cache(
        config, SHAPE, torch.bfloat16, 4096, kv_cache_layout_for(SHAPE), conv_state_dtype=torch.bfloat16, ssm_state_dtype=torch.bfloat16
    )
    assert narrow.state_slot_bytes == 18 * (3 * 6144 * 2 + 16 * 128 * 128 * 2) == 10_100_736
    assert wide.num_state_slots == budget * 3 // 4 // SLOT_BYTES == 41
    assert narrow.num_state_slots == budget * 3 // 4 // narrow.state_slot_bytes == 79


def test_speculation_plans_a_draft_slot_per_draft_for_each_request():
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    plan = _plan(kv_cache_memory_bytes=2 << 30, max_num_seqs=8, speculative_config=spec)
    assert plan.num_state_draft_slots == 3
    assert plan.num_state_slots == 8 * (1 + 3 + 1)  # live and draft slots, and one checkpoint a request
    assert _plan(kv_cache_memory_bytes=2 << 30, max_num_seqs=8, speculative_config=spec, enable_prefix_caching=False).num_state_slots == 32
    # A budget short of one request's slots (and one checkpoint) is refused by name.
    with pytest.raises(ValueError, match=r"holds no 5 state slots of 18.6 MiB .* raise the KV cache budget"):
        _plan(kv_cache_memory_bytes=64 << 20, max_num_seqs=8, speculative_config=spec)
    with pytest.raises(ValueError, match="num_state_slots=3 cannot hold one request's state and its 3 draft states; set at least 4"):
        _plan(num_state_slots=3, speculative_config=spec)
    assert _plan(max_num_seqs=8).num_state_draft_slots == 0


def test_explicit_slots_and_tensor_parallel_ranks():
    assert _plan(num_state_slots=5).num_state_slots == 5
    two = plan_kv_cache(
        EngineConfig(max_model_len=4096, tensor_parallel_size=2, kv_cache_memory_bytes=1 << 30), SHAPE, torch.bfloat16, 4096,
        kv_cache_layout_for(SHAPE), conv_state_dtype=torch.bfloat16,
    )
    assert two.state_slot_bytes == SLOT_BYTES // 2  # each rank holds half the heads' state


def test_a_manager_that_keeps_whole_contexts_refuses_a_hybrid_model():
    with pytest.raises(ValueError, match="recurrent state"):
        kv_cache_layout_for(SHAPE, "contiguous")
