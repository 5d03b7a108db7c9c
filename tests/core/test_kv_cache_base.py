"""The KV cache manager registry and the scheduler's read-only statistics, without a model."""
import pytest
from sched_utils import make_request, make_scheduler, run_to_completion

from pagellm.core.kv_cache_base import (
    KVCacheBlocks,
    create_kv_cache_manager,
    kv_cache_manager_names,
    register_kv_cache_manager,
)
from pagellm.core.kv_cache_manager import KVCacheManager


def test_paged_manager_is_registered_and_created_by_name():
    kv = create_kv_cache_manager("paged", num_blocks=8, block_size=4, max_model_len=32, enable_caching=True)
    assert type(kv) is KVCacheManager
    assert (kv.num_blocks, kv.block_size, kv.enable_caching) == (8, 4, True)
    assert "paged" in kv_cache_manager_names()


def test_unknown_name_lists_the_registered_ones():
    with pytest.raises(ValueError, match=r"unknown KV cache manager 'nope'; registered: \[.*'paged'"):
        create_kv_cache_manager("nope", 8, 4, 32, True)


def test_a_name_cannot_be_taken_twice():
    register_kv_cache_manager("paged")(KVCacheManager)  # the same class again is harmless
    with pytest.raises(ValueError, match="already registered"):
        register_kv_cache_manager("paged")(type("Other", (KVCacheManager,), {}))


def test_allocate_slots_returns_the_new_blocks_typed():
    sched = make_scheduler(num_blocks=8, block_size=4)
    request = make_request(sched, "a", list(range(1, 10)), max_tokens=1)
    got = sched.kv_cache_manager.allocate_slots(request, 9)
    assert isinstance(got, KVCacheBlocks)
    assert got.block_ids == [0, 1, 2]
    assert KVCacheBlocks().block_ids == []


def test_stats_are_cumulative_and_reading_changes_nothing():
    sched = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64)
    prefix = list(range(1, 17))  # 4 full blocks
    sched.add_request(make_request(sched, "a", prefix + [20, 21], max_tokens=2))
    run_to_completion(sched)
    sched.add_request(make_request(sched, "b", prefix + [30, 31], max_tokens=2))
    sched.schedule()
    first, second = sched.stats(), sched.stats()
    assert first == second
    # a looked up 18 tokens and found none; b found a's 4 blocks (16 tokens).
    assert (first.prefix_cache_queries, first.prefix_cache_hits) == (36, 16)
    assert (first.num_running_reqs, first.num_waiting_reqs) == (1, 0)
    assert first.num_running_tokens == 18
    assert first.num_block_table_entries == 5
    assert first.num_used_blocks == 5 and first.num_blocks == 64
