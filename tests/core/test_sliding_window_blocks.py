"""Exact block ids for KV cache groups with sliding windows: release while decoding and across
prefill chunks, preemption, prefix-cache hits, two groups allocating atomically.

Block size 4 and window 8 throughout: a query at position q reads positions q - 7 .. q, so a
step whose first position is c frees the blocks wholly before c - 7. A pool with a sliding group
reserves block 0 as the null block, so requests get ids from 1. Every step runs under
``WindowCheckingRunner``, which checks each read of the window finds the right keys.
"""
from kv_groups_utils import WindowCheckingRunner, make_grouped_scheduler, make_request, step, tables

from pagellm.core.kv_cache_groups import group_layers
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams

SLIDING = [8, 8]  # two layers, both window 8: one sliding group (Mistral's shape)
FULL_AND_SLIDING = [None, 8]  # one full-attention layer, one sliding: two groups of one layer


def test_decoding_past_the_window_releases_the_oldest_blocks():
    sched = make_grouped_scheduler(SLIDING, num_blocks=8)
    sched.add_request(make_request(sched, "a", list(range(1, 7)), max_tokens=12))
    runner = WindowCheckingRunner.for_scheduler(sched)
    kv = sched.kv_cache_manager
    seen = []
    for _ in range(12):
        out = step(sched, runner)
        if "a" in sched.requests:
            seen.append((out.num_scheduled_tokens["a"], tables(sched, "a")[0], kv.num_held_blocks("a")))
    assert seen == [
        (6, [1, 2], 2),  # positions 0-5
        (1, [1, 2], 2),  # 6
        (1, [1, 2], 2),  # 7
        (1, [1, 2, 3], 3),  # 8 opens block 3
        (1, [1, 2, 3], 3),
        (1, [1, 2, 3], 3),
        (1, [0, 2, 3], 2),  # 11 reads 4-11: block 1 (positions 0-3) is freed, its entry nulled
        (1, [0, 2, 3, 4], 3),  # 12: block 4 from the head of the free queue, 1 waits at its tail
        (1, [0, 2, 3, 4], 3),
        (1, [0, 2, 3, 4], 3),
        (1, [0, 0, 3, 4], 2),  # 15 reads 8-15
    ]
    assert kv.block_pool.free_queue.block_ids() == [6, 7, 1, 2, 5, 4, 3]
    assert kv.block_pool.num_used_blocks == 0


def test_chunked_prefill_frees_what_the_next_chunk_cannot_reach():
    sched = make_grouped_scheduler(SLIDING, num_blocks=16, max_num_batched_tokens=6)
    sched.add_request(make_request(sched, "a", list(range(1, 21)), max_tokens=2))
    runner = WindowCheckingRunner.for_scheduler(sched)
    seen = []
    while sched.has_unfinished_requests():
        out = step(sched, runner)
        new = out.new_reqs[0].block_ids if out.new_reqs else out.cached_reqs[0].new_block_ids
        seen.append((out.num_scheduled_tokens["a"], new, tables(sched, "a")[0] if "a" in sched.requests else None))
    assert seen == [
        (6, [1, 2], [1, 2]),
        (6, [3], [1, 2, 3]),
        # The chunk 12-17 starts reading at 5: block 1 (0-3) goes back before its two new blocks are taken.
        (6, [4, 5], [0, 2, 3, 4, 5]),
        (2, [], [0, 0, 3, 4, 5]),  # 18-19 read from 11
        (1, [6], None),  # the decode at 20 reads 13-20, then the request is done
    ]
    sched.kv_cache_manager.check_integrity()


def test_preemption_frees_every_block_and_recompute_starts_over():
    sched = make_grouped_scheduler(SLIDING, num_blocks=6)  # the null block and 5 for requests
    sched.add_request(make_request(sched, "a", list(range(1, 9)), max_tokens=6))
    sched.add_request(make_request(sched, "b", list(range(11, 19)), max_tokens=6))
    runner = WindowCheckingRunner.for_scheduler(sched)
    outs = [step(sched, runner) for _ in range(7)]
    assert [dict(o.num_scheduled_tokens) for o in outs] == [
        {"a": 8, "b": 8},
        {"a": 1},  # a's position 8 needs a third block: b, the newest, is preempted
        {"a": 1},
        {"a": 1},  # b needs 3 blocks to recompute its 9 tokens, only 2 are free
        {"a": 1, "b": 9},  # a at 11 frees block 1, which lets b in
        {"a": 1},  # a at 12 needs a block: b is preempted again; a finishes
        {"b": 10},
    ]
    assert outs[0].new_reqs[1].block_ids == [3, 4]
    assert outs[1].cached_reqs[0].new_block_ids == [5] and outs[1].preempted_req_ids == {"b"}
    assert outs[4].new_reqs[0].block_ids == [4, 3, 1]  # b's freed blocks, then a's released one
    assert outs[5].cached_reqs[0].new_block_ids == [1] and outs[5].preempted_req_ids == {"b"}
    assert outs[6].new_reqs[0].block_ids == [3, 4, 1]
    while sched.has_unfinished_requests():
        step(sched, runner)
    assert sched.kv_cache_manager.block_pool.num_used_blocks == 0


def run_prompt(sched, req_id, prompt):
    sched.add_request(make_request(sched, req_id, prompt, max_tokens=1))
    runner = WindowCheckingRunner.for_scheduler(sched)
    while sched.has_unfinished_requests():
        step(sched, runner)
    return runner


def test_prefix_hit_needs_only_the_window_before_it():
    sched = make_grouped_scheduler(SLIDING, num_blocks=16, enable_caching=True)
    prompt = list(range(1, 21))  # 5 full blocks
    runner = run_prompt(sched, "a", prompt)  # blocks 1-5, all cached, then freed
    sched.add_request(make_request(sched, "b", prompt[:16] + [99, 98, 97]))
    out = step(sched, runner)
    new = out.new_reqs[0]
    # A hit of 16 tokens: position 16 reads 9-15, blocks 3 and 4; the entries before are null.
    assert new.num_computed_tokens == 16 and out.num_scheduled_tokens == {"b": 3}
    assert new.block_ids == [0, 0, 3, 4, 6]
    assert sched.kv_cache_manager.prefix_cache_stats.num_hits == 16


def test_prefix_hit_stops_short_where_the_window_was_evicted():
    sched = make_grouped_scheduler(SLIDING, num_blocks=16, enable_caching=True)
    prompt = list(range(1, 21))
    run_prompt(sched, "a", prompt)
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    assert pool.free_queue.block_ids() == [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 5, 4, 3, 2, 1]
    pool.free_blocks(pool.get_new_blocks(11))  # pressure: evicts block 5 (positions 16-19)
    computed, num_hit_tokens = kv.get_computed_blocks(make_request(sched, "b", prompt + [99]))
    # 5 blocks would be a hit of 20, whose window needs block 5: the longest that works is 16.
    assert num_hit_tokens == 16 and computed.block_ids == [0, 0, 3, 4]


def test_two_groups_hit_takes_each_groups_blocks():
    sched = make_grouped_scheduler(FULL_AND_SLIDING, num_blocks=16, enable_caching=True)
    prompt = list(range(1, 21))
    runner = run_prompt(sched, "a", prompt)  # full-attention blocks 1-5, sliding 6-10
    sched.add_request(make_request(sched, "b", prompt[:16] + [99, 98, 97]))
    out = step(sched, runner)
    # The full group serves all 16 tokens, the sliding group the window before them (blocks 8, 9).
    assert out.new_reqs[0].block_ids_by_group == ([1, 2, 3, 4, 11], [0, 0, 8, 9, 12])
    while sched.has_unfinished_requests():
        step(sched, runner)


def test_two_groups_hit_agrees_on_the_shorter_length():
    sched = make_grouped_scheduler(FULL_AND_SLIDING, num_blocks=16, enable_caching=True)
    prompt = list(range(1, 21))
    run_prompt(sched, "a", prompt)
    kv = sched.kv_cache_manager
    pool = kv.block_pool
    # Freed group by group, each table tail first.
    assert pool.free_queue.block_ids() == [11, 12, 13, 14, 15, 5, 4, 3, 2, 1, 10, 9, 8, 7, 6]
    pool.free_blocks(pool.get_new_blocks(7))  # pressure: evicts full-attention blocks 5 and 4
    c = make_request(sched, "c", prompt + [99])
    computed, num_hit_tokens = kv.get_computed_blocks(c)
    # The full group has 12 tokens left; the sliding group, asked again for 12, has blocks 7 and 8.
    assert num_hit_tokens == 12
    assert computed.block_ids_by_group == ([1, 2, 3], [0, 7, 8])
    # Both groups adopt their hits before either takes new blocks, so no hit is handed out anew.
    assert kv.allocate_slots(c, 9, computed).block_ids_by_group == ([10, 9, 6], [11, 12, 13])
    kv.check_integrity()


def test_two_groups_allocate_together_or_not_at_all():
    kv = KVCacheManager(6, 4, 64, False, kv_cache_layout=group_layers(FULL_AND_SLIDING))
    a = Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=8), 8)
    b = Request("b", [5, 6, 7, 8], SamplingParams(max_tokens=8), 8)
    assert kv.allocate_slots(a, 4).block_ids_by_group == ([1], [2])
    assert kv.allocate_slots(b, 4).block_ids_by_group == ([3], [4])
    a.num_computed_tokens = 4
    # Position 4 needs a block in each group; one is free: nothing changes.
    assert kv.allocate_slots(a, 1) is None
    assert kv.get_block_ids_by_group("a") == ([1], [2]) and kv.block_pool.num_free_blocks == 1
    kv.check_integrity()
    kv.free(b)  # full-attention group first, each table tail first: free queue 5, 3, 4
    assert kv.allocate_slots(a, 1).block_ids_by_group == ([5], [3])
    assert kv.num_held_blocks("a") == 4
    kv.check_integrity()


def test_a_window_release_counts_toward_the_step_it_makes_room_for():
    kv = KVCacheManager(6, 4, 64, False, kv_cache_layout=group_layers([None, 4]))  # window 4
    a = Request("a", list(range(1, 9)), SamplingParams(max_tokens=8), 8)
    assert kv.allocate_slots(a, 8).block_ids_by_group == ([1, 2], [3, 4])
    a.num_computed_tokens = 8
    # Position 8 reads 5-8: block 3 (0-3) is released, and the step then fits in the one free block plus it.
    assert kv.block_pool.num_free_blocks == 1
    assert kv.allocate_slots(a, 1).block_ids_by_group == ([5], [3])
    assert kv.get_block_ids_by_group("a") == ([1, 2, 5], [0, 4, 3])
    kv.check_integrity()
    kv.free(a)
    assert kv.block_pool.num_used_blocks == 0 and kv.block_pool.free_queue.block_ids() == [5, 2, 1, 3, 4]
    kv.check_integrity()
