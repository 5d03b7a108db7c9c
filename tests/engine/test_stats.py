"""Engine statistics: step totals, and the Prometheus counters that advance from cumulative snapshots."""
import dataclasses

import pytest
from prometheus_client import CollectorRegistry

from pagellm.core.scheduler import SchedulerStats
from pagellm.engine.stats import EngineStats, StepStats, StepTotals
from pagellm.entrypoints.metrics import EngineMetrics


def test_step_totals_split_prefill_and_decode_steps():
    totals = StepTotals()
    totals.add(StepStats(num_scheduled_tokens=300, num_reqs=3, num_prefill_tokens=298, duration_s=0.5))
    totals.add(StepStats(num_scheduled_tokens=3, num_reqs=3, num_prefill_tokens=0, duration_s=0.1))
    totals.add(StepStats(num_scheduled_tokens=3, num_reqs=3, num_prefill_tokens=0, duration_s=0.2, comm_s=0.05))
    assert totals == StepTotals(
        num_steps=3,
        prefill_steps_s=0.5,
        prefill_tokens=298,
        decode_steps_s=pytest.approx(0.3),
        decode_tokens=6,
        steps_s=pytest.approx(0.8),
        comm_s=0.05,
    )
    stats = EngineStats(scheduler=None, steps=totals)
    assert stats.prefill_tokens_per_s == pytest.approx(596)
    assert stats.decode_tokens_per_s == pytest.approx(20)
    assert EngineStats(scheduler=None).decode_tokens_per_s is None


def scheduler_stats(**kw) -> SchedulerStats:
    base = dict(
        num_running_reqs=2, num_waiting_reqs=1, kv_cache_usage=0.25, num_blocks=100, num_used_blocks=25,
        num_cached_free_blocks=3, prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
        num_running_tokens=40, num_block_table_entries=5,
    )
    return SchedulerStats(**{**base, **kw})


def test_metrics_advance_by_the_difference_of_cumulative_counters():
    registry = CollectorRegistry()
    metrics = EngineMetrics("m", registry=registry)

    def value(name: str) -> float:
        return registry.get_sample_value(name, {"model_name": "m"})

    metrics.record_step(EngineStats(scheduler_stats(prefix_cache_queries=100, prefix_cache_hits=64, num_preemptions=1)), 0.0)
    metrics.record_step(EngineStats(scheduler_stats(prefix_cache_queries=100, prefix_cache_hits=64, num_preemptions=1)), 0.1)
    later = scheduler_stats(prefix_cache_queries=150, prefix_cache_hits=96, num_preemptions=3, num_waiting_reqs=0)
    metrics.record_step(EngineStats(later), 0.2)
    assert value("pagellm:prefix_cache_queries_total") == 150
    assert value("pagellm:prefix_cache_hits_total") == 96
    assert value("pagellm:num_preemptions_total") == 3
    assert value("pagellm:num_requests_waiting") == 0
    assert value("pagellm:kv_cache_usage_perc") == 0.25
    assert dataclasses.replace(later) == later  # snapshots are plain frozen values


def test_a_hybrid_models_state_slots_and_checkpoints_are_metrics():
    from pagellm.core.state_cache import StateCacheStats
    from pagellm.plan.memory_plan import MemoryPlan

    registry = CollectorRegistry()
    metrics = EngineMetrics("m", registry=registry)

    def value(name: str) -> float:
        return registry.get_sample_value(name, {"model_name": "m"})

    metrics.record_memory_plan(MemoryPlan(0, 0, 10 << 20, 0, None, state_bytes=8 << 20, num_state_slots=8))
    metrics.record_step(EngineStats(scheduler_stats(state_cache=StateCacheStats(8, 2, 3, 5, 1))), 0.0)
    metrics.record_step(EngineStats(scheduler_stats(state_cache=StateCacheStats(8, 1, 4, 7, 4))), 0.1)
    assert value("pagellm:state_cache_bytes") == 8 << 20
    assert value("pagellm:state_slots") == 8
    assert value("pagellm:state_slots_live") == 1
    assert value("pagellm:state_checkpoints") == 4
    assert value("pagellm:state_checkpoint_bytes") == 4 << 20
    assert value("pagellm:state_checkpoints_saved_total") == 7
    assert value("pagellm:state_checkpoints_restored_total") == 4


def test_the_offloading_tiers_counters_and_the_dashboards_point():
    from pagellm.core.kv_tier import KVTierCoreStats
    from pagellm.entrypoints.dashboard.hub import StatsSampler
    from pagellm.kv_offload.offloader import OffloaderStats

    registry = CollectorRegistry()
    metrics = EngineMetrics("m", registry=registry)

    def value(name: str) -> float:
        return registry.get_sample_value(name, {"model_name": "m"})

    def worker(**kw) -> OffloaderStats:
        fields = {f.name: 0 for f in dataclasses.fields(OffloaderStats)}
        return OffloaderStats(**{**fields, "capacity_bytes": 1 << 30, **kw})

    sampler = StatsSampler(metrics)
    core = KVTierCoreStats(num_keys=10, num_saves=10, num_loads=1, num_blocks_loaded=4, num_hit_tokens=64)
    metrics.record_step(EngineStats(scheduler_stats(kv_tier=core, kv_tier_worker=worker(bytes_written=5000, bytes_used=5000))), 0.0)
    sampler.sample(now=100.0)
    core = dataclasses.replace(
        core, num_loads=3, num_blocks_loaded=9, num_blocks_failed=1, num_hit_tokens=144,
        num_state_saves=5, num_states_loaded=2, num_states_failed=1,
    )
    after = worker(bytes_written=7000, bytes_read=3_000_000, num_corrupt=1)
    stats = scheduler_stats(kv_tier=core, kv_tier_worker=after, num_loading_reqs=2)
    metrics.record_step(EngineStats(stats), 0.1)
    assert value("pagellm:kv_tier_loads_total") == 3 and value("pagellm:kv_tier_blocks_loaded_total") == 9
    assert value("pagellm:kv_tier_hit_tokens_total") == 144 and value("pagellm:kv_tier_blocks_failed_total") == 1
    assert value("pagellm:kv_tier_bytes_written_total") == 7000 and value("pagellm:kv_tier_corrupt_total") == 1
    assert value("pagellm:kv_tier_pages") == 10 and value("pagellm:kv_tier_capacity_bytes") == 1 << 30
    assert value("pagellm:kv_tier_state_saves_total") == 5 and value("pagellm:kv_tier_states_loaded_total") == 2
    assert value("pagellm:kv_tier_states_failed_total") == 1
    assert value("pagellm:num_requests_loading") == 2
    point = sampler.sample(now=102.0)
    assert point["tier_hit_tps"] == pytest.approx(40.0) and point["tier_read_mbps"] == pytest.approx(1.5)
    assert point["tier_write_mbps"] == pytest.approx(0.001) and point["tier_pages"] == 10
