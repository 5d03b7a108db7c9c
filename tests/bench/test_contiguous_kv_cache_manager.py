import pytest
from sched_utils import FakeRunner, expected_output, run_to_completion

from pagellm.bench.baseline import ContiguousKVCacheManager, StaticBatchScheduler
from pagellm.core.kv_cache_base import KVCacheBlocks
from pagellm.core.scheduler import Scheduler
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams


def req(req_id: str, num_prompt: int, max_tokens: int) -> Request:
    return Request(req_id, list(range(1, num_prompt + 1)), SamplingParams(max_tokens=max_tokens), max_tokens)


def admit(kv: ContiguousKVCacheManager, request: Request):
    blocks = kv.allocate_slots(request, request.num_prompt_tokens)
    return None if blocks is None else blocks.block_ids


def test_reserves_prompt_plus_max_tokens_as_one_run_first_fit():
    kv = ContiguousKVCacheManager(num_blocks=16, block_size=4, max_model_len=64)
    assert admit(kv, req("a", 5, 6)) == [0, 1, 2]  # 11 tokens -> 3 blocks
    assert admit(kv, req("b", 4, 4)) == [3, 4]
    assert admit(kv, req("c", 1, 20)) == [5, 6, 7, 8, 9, 10]  # 21 tokens -> 6 blocks
    assert kv.get_block_ids("b") == [3, 4]
    assert kv.num_reserved_blocks == 11
    assert kv.free_runs() == [(11, 5)]
    assert kv.usage() == 11 / 16
    kv.check_integrity()


def test_reservation_is_capped_by_max_model_len_and_can_be_max_model_len():
    kv = ContiguousKVCacheManager(num_blocks=16, block_size=4, max_model_len=16)
    assert admit(kv, req("a", 10, 100)) == [0, 1, 2, 3]  # capped at 16 tokens
    kv2 = ContiguousKVCacheManager(num_blocks=16, block_size=4, max_model_len=16, reserve="max_model_len")
    assert admit(kv2, req("short", 1, 1)) == [0, 1, 2, 3]  # 2 tokens, yet a full 16-token slab
    assert admit(kv2, req("next", 1, 1)) == [4, 5, 6, 7]
    kv2.reserve = "bogus"
    with pytest.raises(ValueError, match="reserve"):
        admit(kv2, req("bad", 1, 1))


def test_running_request_never_gets_new_blocks():
    kv = ContiguousKVCacheManager(num_blocks=8, block_size=4, max_model_len=64)
    r = req("a", 3, 9)  # 12 tokens -> blocks 0..2
    assert admit(kv, r) == [0, 1, 2]
    r.num_computed_tokens = 3
    for _ in range(8):  # decode up to the reserved 11 computed tokens
        assert kv.allocate_slots(r, 1).block_ids == []
        r.num_computed_tokens += 1
    assert kv.get_block_ids("a") == [0, 1, 2]
    r.num_computed_tokens = 12
    with pytest.raises(RuntimeError, match="reserved only 12"):
        kv.allocate_slots(r, 1)


def test_free_coalesces_and_first_fit_reuses_lowest_hole():
    kv = ContiguousKVCacheManager(num_blocks=12, block_size=4, max_model_len=64)
    a, b, c, d = req("a", 4, 4), req("b", 4, 8), req("c", 4, 4), req("d", 4, 4)
    assert admit(kv, a) == [0, 1]
    assert admit(kv, b) == [2, 3, 4]
    assert admit(kv, c) == [5, 6]
    assert admit(kv, d) == [7, 8]
    kv.free(a)
    kv.free(c)
    assert kv.free_runs() == [(0, 2), (5, 2), (9, 3)]
    # Two blocks fit in the first hole; three only at the end.
    assert admit(kv, req("e", 4, 4)) == [0, 1]
    assert admit(kv, req("f", 4, 8)) == [9, 10, 11]
    assert kv.free_runs() == [(5, 2)]
    kv.free(b)  # [2,5) joins [5,7)
    assert kv.free_runs() == [(2, 5)]
    kv.free(d)  # and [7,9) joins that
    assert kv.free_runs() == [(2, 7)]
    kv.check_integrity()
    kv.free(d)  # freeing twice is harmless: the request no longer holds anything
    assert kv.free_runs() == [(2, 7)]


def test_refuses_when_no_run_fits_despite_enough_free_blocks():
    kv = ContiguousKVCacheManager(num_blocks=8, block_size=4, max_model_len=64)
    a, b, c, d = (req(x, 4, 4) for x in "abcd")
    for r in (a, b, c, d):
        admit(kv, r)
    kv.free(a)
    kv.free(c)
    assert kv.block_pool.num_free_blocks == 4
    assert kv.largest_free_run() == 2
    big = req("big", 4, 12)  # 16 tokens -> 4 blocks: free in total, but not contiguous
    assert admit(kv, big) is None
    assert kv.num_refusals == 1
    assert kv.get_block_ids("big") == []
    kv.check_integrity()
    kv.free(b)
    assert admit(kv, big) == [0, 1, 2, 3]


def test_request_larger_than_the_whole_cache_is_a_clear_error():
    kv = ContiguousKVCacheManager(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="whole KV cache has 4"):
        admit(kv, req("huge", 10, 10))


def test_no_prefix_cache():
    kv = ContiguousKVCacheManager(num_blocks=4, block_size=4, max_model_len=64)
    assert kv.enable_caching is False
    assert kv.get_computed_blocks(req("a", 9, 1)) == (KVCacheBlocks(), 0)
    assert kv.reset_prefix_cache() is True


def make_static_scheduler(num_blocks: int, block_size: int = 4, max_model_len: int = 64, **kv_kwargs) -> Scheduler:
    kv = ContiguousKVCacheManager(num_blocks, block_size, max_model_len, **kv_kwargs)
    return StaticBatchScheduler(kv, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=max_model_len)


def test_static_batches_with_contiguous_reservations_through_the_scheduler():
    sched = make_static_scheduler(num_blocks=8)
    prompts = {str(i): [i + 1, i + 2, i + 3] for i in range(5)}
    for req_id, prompt in prompts.items():
        # 3 + 5 = 8 tokens -> 2 blocks each: 4 requests fit in 8 blocks.
        sched.add_request(Request(req_id, prompt, SamplingParams(max_tokens=5), 5))
    out = sched.schedule()
    assert [r.req_id for r in out.new_reqs] == ["0", "1", "2", "3"]
    assert [r.block_ids for r in out.new_reqs] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    runner = FakeRunner(4)
    in_flight = []
    sched.update_from_output(out, runner.execute(out, sched.requests))
    outputs: dict[str, list[int]] = {}
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert all(c.new_block_ids == [] for c in out.cached_reqs)  # never grows
        in_flight.append(len(sched.running))
        for o in sched.update_from_output(out, runner.execute(out, sched.requests)):
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
        sched.kv_cache_manager.check_integrity()
    assert sched.num_preemptions == 0
    assert max(in_flight) == 4
    # Request 4 only starts once the first batch has fully drained, and reuses the first run.
    assert outputs["4"] == expected_output(prompts["4"], 5)
    assert sched.kv_cache_manager.free_runs() == [(0, 8)]


def test_variable_lengths_finish_correctly_without_preemption():
    sched = make_static_scheduler(num_blocks=24, block_size=4, max_model_len=40)
    specs = [(5, 30), (3, 2), (7, 12), (2, 1), (9, 20), (4, 4)]
    for i, (num_prompt, max_tokens) in enumerate(specs):
        prompt = list(range(10 * i + 1, 10 * i + 1 + num_prompt))
        sched.add_request(Request(str(i), prompt, SamplingParams(max_tokens=max_tokens), max_tokens))
    outputs = run_to_completion(sched)
    for i, (num_prompt, max_tokens) in enumerate(specs):
        prompt = list(range(10 * i + 1, 10 * i + 1 + num_prompt))
        assert outputs[str(i)] == expected_output(prompt, max_tokens)
    assert sched.num_preemptions == 0
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 24
