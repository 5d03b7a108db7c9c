"""Random arrivals, aborts, growth and preemptions: the pool's books must balance after every step."""
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_utils import FakeRunner, expected_output, make_request, make_scheduler

from pagellm.request import RequestStatus

request_st = st.tuples(
    st.lists(st.integers(1, 6), min_size=1, max_size=30),  # prompt (small alphabet: shared prefixes happen)
    st.integers(1, 12),  # max_tokens
    st.integers(0, 6),  # arrival step
    st.one_of(st.none(), st.integers(1, 20)),  # abort at step
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(request_st, min_size=1, max_size=12),
    num_blocks=st.integers(12, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(4, 48),
    max_num_seqs=st.integers(1, 6),
    caching=st.booleans(),
)
def test_random_workloads_keep_invariants(requests, num_blocks, block_size, budget, max_num_seqs, caching):
    max_model_len = 48
    # Every request must fit the pool on its own, or it could never run.
    if num_blocks * block_size < max_model_len:
        num_blocks = -(-max_model_len // block_size)
    sched = make_scheduler(num_blocks, block_size, max_num_seqs, budget, max_model_len, caching)
    runner = FakeRunner(block_size)
    outputs: dict[str, list[int]] = {}
    aborted = set()
    step = 0
    pending = sorted(enumerate(requests), key=lambda x: x[1][2])
    while pending or sched.has_unfinished_requests():
        while pending and pending[0][1][2] <= step:
            i, (prompt, max_tokens, _, _) = pending.pop(0)
            max_tokens = min(max_tokens, max_model_len - len(prompt))
            sched.add_request(make_request(sched, str(i), prompt, max_tokens=max_tokens))
        for i, (_, _, _, abort_at) in enumerate(requests):
            if abort_at == step and str(i) in sched.requests:
                sched.finish_requests([str(i)], RequestStatus.FINISHED_ABORTED)
                aborted.add(str(i))
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= budget
        assert len(out.num_scheduled_tokens) <= max_num_seqs
        res = runner.execute(out, sched.requests)
        for o in sched.update_from_output(out, res):
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
        kv = sched.kv_cache_manager
        kv.check_integrity()
        # No block owned by two requests unless it is a shared, hashed prefix block.
        owners: dict[int, int] = {}
        for blocks in kv.req_to_blocks.values():
            for b in blocks:
                owners[b.block_id] = owners.get(b.block_id, 0) + 1
                if owners[b.block_id] > 1:
                    assert b.block_hash is not None
        assert kv.block_pool.num_free_blocks + kv.block_pool.num_used_blocks == num_blocks
        step += 1
        assert step < 5000
    assert kv.block_pool.num_used_blocks == 0
    for i, (prompt, max_tokens, _, _) in enumerate(requests):
        if str(i) not in aborted:
            max_tokens = min(max_tokens, max_model_len - len(prompt))
            assert outputs[str(i)] == expected_output(prompt, max_tokens)
