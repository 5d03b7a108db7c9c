from sched_utils import FakeRunner, expected_output, make_request, make_scheduler, run_to_completion

from pagellm.request import RequestStatus


def test_second_request_hits_prefix_blocks():
    sched = make_scheduler(num_blocks=16, block_size=4)
    prompt = list(range(1, 11))  # 10 tokens: blocks [1..4], [5..8] are full
    sched.add_request(make_request(sched, "a", prompt, max_tokens=2))
    run_to_completion(sched)
    kv = sched.kv_cache_manager
    assert kv.block_pool.num_cached_free_blocks >= 2
    sched.add_request(make_request(sched, "b", prompt[:8] + [77, 78, 79], max_tokens=2))
    out = sched.schedule()
    new = out.new_reqs[0]
    assert new.num_computed_tokens == 8
    assert out.num_scheduled_tokens == {"b": 3}
    assert new.block_ids[:2] == [0, 1]  # the same physical blocks as "a"
    assert kv.prefix_cache_stats.num_hits == 8


def test_full_prompt_hit_still_computes_last_token():
    sched = make_scheduler(num_blocks=16, block_size=4)
    prompt = list(range(1, 9))  # exactly two blocks
    sched.add_request(make_request(sched, "a", prompt, max_tokens=1))
    run_to_completion(sched)
    sched.add_request(make_request(sched, "b", prompt, max_tokens=3))
    out = sched.schedule()
    assert out.new_reqs[0].num_computed_tokens == 4  # block 2 holds the last token: recomputed
    assert out.num_scheduled_tokens == {"b": 4}
    runner = FakeRunner(4)
    first = sched.update_from_output(out, runner.execute(out, sched.requests))
    outputs = run_to_completion(sched, runner)
    assert first[0].new_token_ids + outputs["b"] == expected_output(prompt, 3)


def test_shared_blocks_have_two_owners_and_survive_one_finish():
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=64)
    prefix = list(range(1, 9))
    sched.add_request(make_request(sched, "a", prefix + [50], max_tokens=4))
    sched.add_request(make_request(sched, "b", prefix + [60], max_tokens=4))
    out = sched.schedule()
    # Burst: "b" is admitted in the same step and reuses the blocks "a" writes this step.
    assert out.num_scheduled_tokens == {"a": 9, "b": 1}
    kv = sched.kv_cache_manager
    blocks_a, blocks_b = kv.req_to_blocks["a"], kv.req_to_blocks["b"]
    assert blocks_a[:2] == blocks_b[:2]
    assert [b.ref_cnt for b in blocks_a[:2]] == [2, 2]
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert [b.ref_cnt for b in blocks_b[:2]] == [1, 1]
    kv.check_integrity()


def test_burst_behind_chunked_prefix_waits_instead_of_recomputing():
    # Budget 8: "a" needs 3 steps for its 20-token prompt. "b" shares the first 16 tokens.
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    prefix = list(range(1, 17))
    sched.add_request(make_request(sched, "a", prefix + [90, 91, 92, 93], max_tokens=1))
    sched.add_request(make_request(sched, "b", prefix + [80, 81, 82, 83], max_tokens=1))
    sched.add_request(make_request(sched, "c", [7, 7, 7], max_tokens=1))
    runner = FakeRunner(4)
    steps = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        steps.append(dict(out.num_scheduled_tokens))
        sched.update_from_output(out, runner.execute(out, sched.requests))
    total_b = sum(s.get("b", 0) for s in steps)
    assert total_b == 4  # only its own 4 tokens: the 16 shared ones came from "a"
    assert sum(s.get("a", 0) for s in steps) == 20
    # "b" waits while "a" computes the shared blocks, then only computes its own tail.
    assert steps == [{"a": 8}, {"a": 8}, {"a": 4, "b": 4}, {"c": 3}]


def test_waiting_behind_a_pending_prefix_does_not_block_others():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=12)
    prefix = list(range(1, 17))
    sched.add_request(make_request(sched, "a", prefix + [90], max_tokens=1))
    sched.add_request(make_request(sched, "b", prefix + [80], max_tokens=1))
    sched.add_request(make_request(sched, "c", [7, 7, 7], max_tokens=1))
    out = sched.schedule()
    # "a" takes 12 of its 17 tokens; "b" would recompute blocks "a" is about to write, so it
    # waits; "c" shares nothing and is not held up behind "b".
    assert out.num_scheduled_tokens == {"a": 12}
    runner = FakeRunner(4)
    sched.update_from_output(out, runner.execute(out, sched.requests))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 5, "b": 1, "c": 3}


def test_outputs_same_with_and_without_caching_under_eviction():
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, i] for i in range(10)] + [list(range(30, 50))]
    results = []
    for caching in (True, False):
        sched = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=16, enable_caching=caching)
        for i, p in enumerate(prompts):
            sched.add_request(make_request(sched, str(i), p, max_tokens=5))
        results.append(run_to_completion(sched))
    assert results[0] == results[1]
    for i, p in enumerate(prompts):
        assert results[0][str(i)] == expected_output(p, 5)


def test_cache_salt_isolates_tenants():
    sched = make_scheduler(num_blocks=16, block_size=4)
    prompt = list(range(1, 11))
    r = make_request(sched, "a", prompt, max_tokens=1)
    sched.add_request(r)
    run_to_completion(sched)
    from pagellm.core.block_hash import make_block_hasher
    from pagellm.request import Request
    from pagellm.sampling_params import SamplingParams

    salted = Request("b", prompt, SamplingParams(max_tokens=1), 1, cache_salt="other", block_hasher=make_block_hasher(4))
    sched.add_request(salted)
    out = sched.schedule()
    assert out.new_reqs[0].num_computed_tokens == 0


def test_prompt_logprobs_request_skips_cache():
    sched = make_scheduler(num_blocks=16, block_size=4)
    prompt = list(range(1, 11))
    sched.add_request(make_request(sched, "a", prompt, max_tokens=1))
    run_to_completion(sched)
    sched.add_request(make_request(sched, "b", prompt, max_tokens=1, prompt_logprobs=1))
    out = sched.schedule()
    assert out.new_reqs[0].num_computed_tokens == 0
