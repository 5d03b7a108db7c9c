"""Property tests over scheduler + KV cache manager + block pool, with prefix caching, tenants'
cache salts, preemption, aborts and prefix-cache resets all mixed (extends
tests/core/test_scheduler_properties.py, which has neither salts nor a model that reads the cache).

The fake runner here keeps a simulated KV cache: it writes each computed token into the slot the
block table names, and "samples" from the tokens it *reads back* from those slots. So a block handed
to the wrong request, shared across tenants, evicted while still in use or overwritten while cached
would change what is read, and is caught on the spot, not just as a bookkeeping mismatch.
"""
from __future__ import annotations

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagellm.core.block_hash import make_block_hasher
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.core.scheduler import Scheduler
from pagellm.request import Request, RequestStatus
from pagellm.sampling_params import SamplingParams

MAX_MODEL_LEN = 48


def fake_token(context: list[int]) -> int:
    """The fake model's next token: a function of the whole context, as a real model's is."""
    return (sum(t * (i + 1) for i, t in enumerate(context)) * 31 + len(context)) % 1000 + 1000


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        tokens.append(fake_token(tokens))
        out.append(tokens[-1])
    return out


class KVReadingRunner:
    """Executes scheduler outputs against a simulated paged KV cache (one token id per slot)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.kv: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.state: dict[str, dict] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        for req_id in out.finished_req_ids:
            self.state.pop(req_id, None)
        for new in out.new_reqs:
            assert new.req_id not in self.state, "a request was admitted twice without leaving"
            self.state[new.req_id] = {"tokens": list(new.token_ids), "computed": new.num_computed_tokens, "blocks": list(new.block_ids)}
        for cached in out.cached_reqs:
            st_ = self.state[cached.req_id]
            st_["blocks"].extend(cached.new_block_ids)
            assert st_["computed"] == cached.num_computed_tokens
        # Every layer writes the whole batch's K/V before attending, so write all, then read.
        for req_id, n in out.num_scheduled_tokens.items():
            st_ = self.state[req_id]
            assert st_["computed"] + n <= len(st_["tokens"])
            for pos in range(st_["computed"], st_["computed"] + n):
                self.kv[st_["blocks"][pos // bs]][pos % bs] = st_["tokens"][pos]
            st_["computed"] += n
        sampled = {}
        for req_id in out.num_scheduled_tokens:
            st_ = self.state[req_id]
            if st_["computed"] < len(st_["tokens"]):
                continue  # a prefill chunk: nothing to sample yet
            context = [self.kv[st_["blocks"][pos // bs]][pos % bs] for pos in range(len(st_["tokens"]))]
            assert context == st_["tokens"], f"request {req_id} read a KV cache that is not its own context"
            token = fake_token(context)
            st_["tokens"].append(token)
            sampled[req_id] = [token]
        return ModelRunnerOutput(sampled_token_ids=sampled)


PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5]]
request_st = st.tuples(
    st.sampled_from(range(len(PREFIXES))),  # a shared prefix: hits happen
    st.lists(st.integers(1, 4), min_size=0, max_size=20),  # the request's own suffix
    st.integers(1, 14),  # max_tokens
    st.integers(0, 4),  # arrival step
    st.one_of(st.none(), st.integers(0, 30)),  # abort at step (maybe while waiting or preempted)
    st.sampled_from([None, None, "tenant-a", "tenant-b"]),  # cache_salt
)


def check_invariants(sched: Scheduler, kv: KVCacheManager, num_blocks: int) -> None:
    kv.check_integrity()  # free queue sound, ref_cnt == number of owners, index consistent
    pool = kv.block_pool
    assert pool.num_free_blocks + pool.num_used_blocks == num_blocks
    owners_salt: dict[int, set] = {}
    for req_id, blocks in kv.req_to_blocks.items():
        request = sched.requests[req_id]
        assert request.status == RequestStatus.RUNNING, "only running requests hold blocks"
        assert len(blocks) * kv.block_size >= request.num_computed_tokens
        for i, block in enumerate(blocks):
            owners_salt.setdefault(block.block_id, set()).add(request.cache_salt)
            if block.block_hash is not None:
                # A hashed block holds exactly this request's i-th block of content.
                assert block.block_hash == request.block_hashes[i]
    for block_id, salts in owners_salt.items():
        block = pool.blocks[block_id]
        if block.ref_cnt > 1:
            assert block.block_hash is not None, "blocks are shared only through the prefix cache"
            assert len(salts) == 1, f"block {block_id} is shared across tenants {salts}"
    for request in list(sched.waiting):
        assert request.request_id not in kv.req_to_blocks or not kv.req_to_blocks[request.request_id]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    requests=st.lists(request_st, min_size=1, max_size=14),
    extra_blocks=st.integers(0, 8),  # beyond the minimum: a small pool preempts often
    block_size=st.sampled_from([2, 4, 8]),
    budget=st.integers(4, 40),
    max_num_seqs=st.integers(1, 10),
    reset_steps=st.sets(st.integers(0, 60), max_size=3),
)
def test_pool_stays_whole_and_every_read_is_own_context(requests, extra_blocks, block_size, budget, max_num_seqs, reset_steps):
    # Every request must fit the pool alone, or it could never run.
    num_blocks = -(-MAX_MODEL_LEN // block_size) + extra_blocks
    kv = KVCacheManager(num_blocks, block_size, MAX_MODEL_LEN, enable_caching=True)
    sched = Scheduler(kv, max_num_seqs, budget, MAX_MODEL_LEN)
    runner = KVReadingRunner(num_blocks, block_size)
    hasher = make_block_hasher(block_size)
    prompts, max_tokens_of, outputs, aborted = {}, {}, {}, set()
    pending = sorted(enumerate(requests), key=lambda x: x[1][3])
    step = 0
    while pending or sched.has_unfinished_requests():
        while pending and pending[0][1][3] <= step:
            i, (prefix, suffix, max_tokens, _, _, salt) = pending.pop(0)
            prompt = (PREFIXES[prefix] + suffix)[: MAX_MODEL_LEN - 1]
            max_tokens = min(max_tokens, MAX_MODEL_LEN - len(prompt))
            prompts[str(i)], max_tokens_of[str(i)] = prompt, max_tokens
            params = SamplingParams(max_tokens=max_tokens, temperature=0)
            sched.add_request(Request(str(i), prompt, params, max_tokens, cache_salt=salt, block_hasher=hasher))
        for i, (*_, abort_at, _) in enumerate(requests):
            if abort_at == step and str(i) in sched.requests:
                sched.finish_requests([str(i)], RequestStatus.FINISHED_ABORTED)
                aborted.add(str(i))
        if step in reset_steps:
            # Refused while blocks are in use; when it runs, nothing may be found afterwards.
            if kv.reset_prefix_cache():
                assert not kv.block_pool.cached_blocks
        out = sched.schedule()
        assert out.total_num_scheduled_tokens <= budget and len(out.num_scheduled_tokens) <= max_num_seqs
        for o in sched.update_from_output(out, runner.execute(out)):
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
        check_invariants(sched, kv, num_blocks)
        step += 1
        assert step < 5000, "no progress"
    assert kv.block_pool.num_used_blocks == 0 and not kv.req_to_blocks
    assert kv.block_pool.num_free_blocks == num_blocks
    event(f"preempted: {sched.num_preemptions > 0}")
    event(f"aborted: {bool(aborted)}")
    for req_id, prompt in prompts.items():
        if req_id not in aborted:
            assert outputs[req_id] == expected_output(prompt, max_tokens_of[req_id]), req_id


def test_the_workload_really_preempts_shares_and_isolates():
    """One fixed case of the property above, to show it reaches preemption, sharing and salts."""
    block_size, num_blocks = 4, 12
    kv = KVCacheManager(num_blocks, block_size, MAX_MODEL_LEN, enable_caching=True)
    sched = Scheduler(kv, 8, 64, MAX_MODEL_LEN)
    runner = KVReadingRunner(num_blocks, block_size)
    hasher = make_block_hasher(block_size)
    prompt = PREFIXES[0] + [2, 3]
    for i, salt in enumerate([None, None, "tenant-a", "tenant-a", "tenant-b"]):
        params = SamplingParams(max_tokens=10, temperature=0)
        sched.add_request(Request(str(i), prompt, params, 10, cache_salt=salt, block_hasher=hasher))
    outputs: dict[str, list[int]] = {}
    shared_within_tenant = False
    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        for o in sched.update_from_output(out, runner.execute(out)):
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
        check_invariants(sched, kv, num_blocks)
        shared_within_tenant |= any(b.ref_cnt > 1 for b in kv.block_pool.blocks)
    assert sched.num_preemptions > 0 and shared_within_tenant
    assert all(outputs[str(i)] == expected_output(prompt, 10) for i in range(5))
    assert kv.block_pool.num_used_blocks == 0
