"""Pooling requests in the scheduler, without a model: prefill only, then finished with their vector."""
from __future__ import annotations

from sched_utils import FakeRunner, fake_embedding, make_pooling_request, make_request, make_scheduler

from pagellm.core.scheduler import Scheduler


def step(sched: Scheduler, runner: FakeRunner):
    out = sched.schedule()
    outputs = sched.update_from_output(out, runner.execute(out, sched.requests))
    sched.kv_cache_manager.check_integrity()
    return out, outputs


def test_a_pooling_request_finishes_with_the_step_that_computes_its_prompt():
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=32)
    runner = FakeRunner(4)
    prompt = list(range(100, 110))
    sched.add_request(make_pooling_request(sched, "p", prompt))
    free_before = sched.kv_cache_manager.block_pool.num_free_blocks
    out, outputs = step(sched, runner)
    assert out.num_scheduled_tokens == {"p": 10}
    assert len(outputs) == 1
    (o,) = outputs
    assert o.req_id == "p" and o.finished and o.finish_reason == "stop"
    assert o.new_token_ids == [] and o.pooled == fake_embedding(prompt)
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.block_pool.num_free_blocks == free_before
    assert sched.schedule().num_scheduled_tokens == {}  # nothing left to run: no decode step follows


def test_chunked_prefill_reports_only_when_the_last_chunk_is_done():
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=4)
    runner = FakeRunner(4)
    prompt = list(range(200, 210))
    sched.add_request(make_pooling_request(sched, "p", prompt))
    chunks, finished_at = [], None
    for i in range(5):
        if not sched.has_unfinished_requests():
            break
        out, outputs = step(sched, runner)
        chunks.append(out.num_scheduled_tokens["p"])
        assert all(o.new_token_ids == [] for o in outputs)
        if outputs:
            assert outputs[0].finished and outputs[0].pooled == fake_embedding(prompt)
            finished_at = i
    assert chunks == [4, 4, 2]
    assert finished_at == 2
    assert runner.num_pooled == {"p": 1}


def test_pooling_requests_share_steps_under_the_token_budget():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=16)
    runner = FakeRunner(4)
    prompts = {f"p{i}": list(range(300 + 10 * i, 306 + 10 * i)) for i in range(3)}
    for req_id, prompt in prompts.items():
        sched.add_request(make_pooling_request(sched, req_id, prompt))
    out1, outputs1 = step(sched, runner)
    assert out1.num_scheduled_tokens == {"p0": 6, "p1": 6, "p2": 4}
    assert sorted(o.req_id for o in outputs1) == ["p0", "p1"]
    out2, outputs2 = step(sched, runner)
    assert out2.num_scheduled_tokens == {"p2": 2}
    assert [o.req_id for o in outputs2] == ["p2"] and outputs2[0].pooled == fake_embedding(prompts["p2"])
    assert not sched.has_unfinished_requests()
    assert all(not o.new_token_ids for o in outputs1 + outputs2)


def test_a_preempted_pooling_request_is_recomputed_from_its_first_token_and_pooled_once():
    # A 2-token budget: the pooling prompt creeps in a token a step while the decoding request grows
    # to 5 of the pool's 6 blocks, and the newest running request (the pooling one) must give way.
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=2, enable_caching=False)
    runner = FakeRunner(4)
    sched.add_request(make_request(sched, "g", [1, 2, 3, 4], max_tokens=16))
    prompt = list(range(400, 412))
    sched.add_request(make_pooling_request(sched, "p", prompt))
    pooled, restarts, tokens = [], 0, []
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        out, outputs = step(sched, runner)
        restarts += sum(1 for r in out.new_reqs if r.req_id == "p" and r.num_computed_tokens == 0)
        for o in outputs:
            if o.req_id == "p":
                assert o.new_token_ids == []
                pooled.append(o.pooled)
            else:
                tokens.extend(o.new_token_ids)
    assert not sched.has_unfinished_requests()
    assert sched.num_preemptions >= 1 and restarts >= 2
    assert pooled == [fake_embedding(prompt)]
    assert len(tokens) == 16


def test_a_fully_cached_prompt_still_runs_its_last_token():
    sched = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=32)
    runner = FakeRunner(4)
    prompt = list(range(500, 512))  # three full blocks
    sched.add_request(make_pooling_request(sched, "a", prompt))
    step(sched, runner)
    sched.add_request(make_pooling_request(sched, "b", prompt))
    out, outputs = step(sched, runner)
    # Two blocks come from the cache; the last block runs, since the last token must be computed.
    assert out.new_reqs[0].num_computed_tokens == 8
    assert out.num_scheduled_tokens == {"b": 4}
    assert outputs[0].pooled == fake_embedding(prompt) and outputs[0].num_cached_tokens == 8
