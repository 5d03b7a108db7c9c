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
