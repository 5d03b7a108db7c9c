import pytest

from pagellm.bench.baseline import ContiguousKVCacheManager, StaticBatchScheduler
from pagellm.bench.kv_utilization import KVUsageSample, sample_kv_usage, summarize
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.sched_output import ModelRunnerOutput
from pagellm.core.scheduler import Scheduler
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams


def step(sched: Scheduler) -> None:
    """One engine step without a model: every request whose KV is complete 'samples' token 5."""
    out = sched.schedule()
    sampled = {
        req_id: [5]
        for req_id in out.num_scheduled_tokens
        if sched.requests[req_id].num_computed_tokens == sched.requests[req_id].num_tokens
    }
    sched.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))


def make(kv, static: bool) -> Scheduler:
    scheduler_cls = StaticBatchScheduler if static else Scheduler
    sched = scheduler_cls(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=16)
    for req_id, num_prompt in (("a", 6), ("b", 3)):
        sched.add_request(Request(req_id, list(range(10, 10 + num_prompt)), SamplingParams(max_tokens=4), 4))
    return sched


def test_paged_accounting_exact():
    sched = make(KVCacheManager(num_blocks=8, block_size=4, max_model_len=16, enable_caching=False), static=False)
    step(sched)  # prefill: a holds 6 tokens in 2 blocks, b 3 in 1
    s = sample_kv_usage(sched.stats(), 4, time_s=1.5)
    assert (s.num_running, s.num_waiting) == (2, 0)
    assert s.num_held_tokens == 9
    assert s.num_reserved_tokens == 12
    assert s.num_capacity_tokens == 32
    assert s.num_block_table_entries == 3
    assert s.utilization == pytest.approx(9 / 12)
    assert s.occupancy == pytest.approx(9 / 32)
    assert s.num_wasted_tokens == 3
    step(sched)  # one decode each: a 7 tokens (2 blocks), b 4 (1 block)
    s = sample_kv_usage(sched.stats(), 4, 2.0)
    assert (s.num_held_tokens, s.num_reserved_tokens) == (11, 12)


def test_contiguous_accounting_exact():
    kv = ContiguousKVCacheManager(num_blocks=8, block_size=4, max_model_len=16, reserve="max_model_len")
    sched = make(kv, static=True)
    step(sched)
    s = sample_kv_usage(sched.stats(), 4, 0.0)
    # Both reserved a whole max_model_len slab: 4 blocks each, the entire cache.
    assert (s.num_held_tokens, s.num_reserved_tokens, s.num_block_table_entries) == (9, 32, 8)
    assert s.utilization == pytest.approx(9 / 32)


def test_idle_sample_has_no_utilization():
    s = KVUsageSample(0.0, 0, 0, 0, 0, 64, 0)
    assert s.utilization is None and s.occupancy == 0.0


def test_summarize_weights_and_idle_samples():
    samples = [
        KVUsageSample(0.0, 2, 1, 30, 40, 100, 4),  # 75 %
        KVUsageSample(1.0, 3, 0, 45, 50, 100, 5),  # 90 %
        KVUsageSample(2.0, 0, 0, 0, 0, 100, 0),  # idle: left out of utilization
    ]
    s = summarize(samples, weights=[1.0, 3.0, 2.0])
    assert s.mean_utilization == pytest.approx((0.75 * 1 + 0.9 * 3) / 4)
    assert s.peak_utilization == pytest.approx(0.9)
    assert s.mean_occupancy == pytest.approx((0.30 * 1 + 0.45 * 3 + 0 * 2) / 6)
    assert s.peak_occupancy == pytest.approx(0.45)
    assert s.max_requests_in_flight == 3
    assert s.mean_requests_in_flight == pytest.approx((2 + 9 + 0) / 6)
    assert s.mean_wasted_tokens == pytest.approx((10 * 1 + 5 * 3) / 4)
    assert s.mean_block_table_entries == pytest.approx((4 + 15) / 4)
    assert summarize(samples).mean_utilization == pytest.approx((0.75 + 0.9) / 2)  # unweighted
    with pytest.raises(ValueError):
        summarize([])
    with pytest.raises(ValueError):
        summarize(samples, weights=[1.0])


def test_paged_beats_contiguous_on_the_same_run():
    """Over a whole run the paged layout reserves far less for the same held tokens."""

    def run(kv, static):
        sched = make(kv, static)
        samples = []
        while sched.has_unfinished_requests():
            step(sched)
            samples.append(sample_kv_usage(sched.stats(), 4, 0.0))
        return summarize(samples)

    paged = run(KVCacheManager(8, 4, 16, enable_caching=False), static=False)
    contiguous = run(ContiguousKVCacheManager(8, 4, 16, reserve="max_model_len"), static=True)
    assert paged.mean_utilization > 2 * contiguous.mean_utilization
    assert paged.max_requests_in_flight == contiguous.max_requests_in_flight == 2
