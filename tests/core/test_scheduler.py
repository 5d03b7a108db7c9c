from sched_utils import FakeRunner, expected_output, make_request, make_scheduler, run_to_completion

from pagellm.request import RequestStatus


def test_single_request_prefill_then_decode_exact_blocks():
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=32)
    sched.add_request(make_request(sched, "a", list(range(1, 7)), max_tokens=3))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 6}
    assert [r.req_id for r in out.new_reqs] == ["a"]
    assert out.new_reqs[0].block_ids == [0, 1]  # 6 tokens in blocks of 4
    runner = FakeRunner(4)
    sched.update_from_output(out, runner.execute(out, sched.requests))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.cached_reqs[0].new_block_ids == []  # token 7 fits in block 1
    sched.update_from_output(out, runner.execute(out, sched.requests))
    out = sched.schedule()
    assert out.cached_reqs[0].new_block_ids == []  # token 8 fills block 1
    outs = sched.update_from_output(out, runner.execute(out, sched.requests))
    assert outs[0].finish_reason == "length"
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 8
    sched.kv_cache_manager.check_integrity()


def test_decode_growth_allocates_new_block_on_boundary():
    sched = make_scheduler(num_blocks=8, block_size=4, enable_caching=False)
    sched.add_request(make_request(sched, "a", [1, 2, 3, 4], max_tokens=5))
    runner = FakeRunner(4)
    out = sched.schedule()
    assert out.new_reqs[0].block_ids == [0]
    sched.update_from_output(out, runner.execute(out, sched.requests))
    out = sched.schedule()  # the 5th token needs a second block
    assert out.cached_reqs[0].new_block_ids == [1]


def test_chunked_prefill_respects_token_budget():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=8)
    sched.add_request(make_request(sched, "a", list(range(1, 21)), max_tokens=2))
    sched.add_request(make_request(sched, "b", [5, 6, 7], max_tokens=2))
    runner = FakeRunner(4)
    steps = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        steps.append(dict(out.num_scheduled_tokens))
        assert out.total_num_scheduled_tokens <= 8
        sched.update_from_output(out, runner.execute(out, sched.requests))
    assert steps[0] == {"a": 8}
    assert steps[1] == {"a": 8}
    assert steps[2] == {"a": 4, "b": 3}  # the rest of a's prompt and all of b's
    assert steps[3] == {"a": 1, "b": 1}


def test_max_num_seqs_limits_batch():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(4):
        sched.add_request(make_request(sched, str(i), [i + 1, 2, 3], max_tokens=2))
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["0", "1"]
    assert len(sched.waiting) == 2


def test_preemption_frees_newest_and_output_is_unchanged():
    # 6 blocks of 4 tokens; three requests of 8 prompt tokens each need 2 blocks, then grow.
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, enable_caching=False)
    prompts = {str(i): [10 * i + j for j in range(1, 9)] for i in range(3)}
    for req_id, prompt in prompts.items():
        sched.add_request(make_request(sched, req_id, prompt, max_tokens=6))
    runner = FakeRunner(4)
    outputs: dict[str, list[int]] = {}
    preempted = set()
    while sched.has_unfinished_requests():
        out = sched.schedule()
        preempted |= out.preempted_req_ids
        for o in sched.update_from_output(out, runner.execute(out, sched.requests)):
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
        sched.kv_cache_manager.check_integrity()
    # The newest is evicted first; the oldest request is never the victim.
    assert "2" in preempted and "0" not in preempted
    assert sched.num_preemptions >= 1
    for req_id, prompt in prompts.items():
        assert outputs[req_id] == expected_output(prompt, 6)
    assert sched.kv_cache_manager.block_pool.num_free_blocks == 6


def test_abort_frees_blocks_and_tells_runner():
    sched = make_scheduler(num_blocks=8, block_size=4)
    sched.add_request(make_request(sched, "a", list(range(1, 10)), max_tokens=8))
    sched.add_request(make_request(sched, "b", [1, 2], max_tokens=8))
    runner = FakeRunner(4)
    out = sched.schedule()
    sched.update_from_output(out, runner.execute(out, sched.requests))
    assert sched.kv_cache_manager.block_pool.num_used_blocks == 4
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.block_pool.num_used_blocks == 1
    out = sched.schedule()
    assert "a" in out.finished_req_ids
    assert list(out.num_scheduled_tokens) == ["b"]
    sched.finish_requests(["b", "missing"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests()
    sched.kv_cache_manager.check_integrity()


def test_stop_token_and_min_tokens():
    sched = make_scheduler()
    prompt = [1, 2, 3]
    first = expected_output(prompt, 3)
    req = make_request(sched, "a", prompt, max_tokens=10, stop_token_ids=[first[0]])
    req.sampling_params.all_stop_token_ids |= {first[0]}
    sched.add_request(req)
    outputs = run_to_completion(sched)
    assert outputs["a"] == first[:1]
    assert req.status == RequestStatus.FINISHED_STOPPED and req.stop_reason == first[0]

    sched = make_scheduler()
    req = make_request(sched, "b", prompt, max_tokens=10, min_tokens=2, stop_token_ids=[first[0]])
    sched.add_request(req)
    outputs = run_to_completion(sched)
    assert len(outputs["b"]) == 10  # the stop token came before min_tokens, never again


def test_max_model_len_caps_output():
    sched = make_scheduler(max_model_len=10)
    sched.add_request(make_request(sched, "a", list(range(1, 8)), max_tokens=100))
    outputs = run_to_completion(sched)
    assert len(outputs["a"]) == 3


def test_admission_hook_can_hold_waiting_requests():
    # The hook the static-batching baseline overrides (pagellm/bench/baseline/).
    sched = make_scheduler()
    sched.admits_waiting_requests = lambda: not sched.running
    sched.add_request(make_request(sched, "a", [1, 2, 3], max_tokens=3))
    out = sched.schedule()
    sched.add_request(make_request(sched, "b", [1, 2, 3], max_tokens=3))
    runner = FakeRunner(sched.block_size)
    sched.update_from_output(out, runner.execute(out, sched.requests))
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["a"]
    sched.update_from_output(out, runner.execute(out, sched.requests))
    outputs = run_to_completion(sched, runner)
    assert len(outputs["b"]) == 3
