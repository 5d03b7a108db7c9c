"""Reporting of ``bench compare`` on made-up runs (no model)."""
import json

import pytest

from pagellm.bench.compare import (
    DesignResult,
    compare_result_json,
    format_compare_table,
    format_sweep_table,
    ratios,
    sweep_point,
)
from pagellm.bench.kv_utilization import KVUsageSample, summarize


def design(label, layout, block_size, num_blocks, samples, duration, latencies_ms, steps):
    return DesignResult(
        label=label, kv_layout=layout, reserve="max_model_len" if layout == "contiguous" else None,
        block_size=block_size, num_blocks=num_blocks, num_requests=4, duration_s=duration,
        total_input_tokens=40, total_output_tokens=20, request_throughput=4 / duration,
        output_throughput=20 / duration, total_token_throughput=60 / duration,
        mean_latency_ms=latencies_ms[0], p99_latency_ms=latencies_ms[1], mean_ttft_ms=1.0, p99_ttft_ms=2.0,
        num_preemptions=0, num_steps=steps, utilization=summarize(samples), samples=samples,
    )


PAGED_SAMPLES = [KVUsageSample(0.5, 4, 0, 30, 32, 64, 8), KVUsageSample(1.0, 2, 0, 14, 16, 64, 4)]
CONTIG_SAMPLES = [KVUsageSample(1.0, 2, 2, 20, 64, 64, 16), KVUsageSample(2.0, 2, 0, 24, 64, 64, 16),
                  KVUsageSample(3.0, 0, 0, 0, 0, 64, 0)]


def make_pair():
    paged = design("paged", "paged", 4, 16, PAGED_SAMPLES, duration=2.0, latencies_ms=(1000.0, 1900.0), steps=10)
    contiguous = design("contiguous", "contiguous", 4, 16, CONTIG_SAMPLES, duration=4.0, latencies_ms=(2500.0, 3800.0), steps=20)
    return paged, contiguous


def test_ratios():
    paged, contiguous = make_pair()
    r = ratios(paged, contiguous)
    assert r["kv_utilization"] == pytest.approx(((30 / 32 + 14 / 16) / 2) / ((20 / 64 + 24 / 64) / 2))
    assert r["max_requests_in_flight"] == 2.0
    assert r["mean_requests_in_flight"] == pytest.approx(3 / (4 / 3))
    assert r["output_throughput"] == pytest.approx(2.0)
    assert r["output_tokens_per_step"] == pytest.approx(2.0)
    assert r["mean_latency_speedup"] == pytest.approx(2.5)
    assert r["p99_latency_speedup"] == pytest.approx(2.0)


def test_compare_table_and_json():
    paged, contiguous = make_pair()
    table = format_compare_table([paged, contiguous])
    util_line = next(line for line in table.splitlines() if line.startswith("KV utilization, mean (%)"))
    assert util_line.split()[-3:] == ["90.6", "34.4", "2.64x"]
    steps_line = next(line for line in table.splitlines() if line.startswith("Engine steps"))
    assert steps_line.split()[-2:] == ["10", "20"]
    result = compare_result_json([paged, contiguous], [], {"dataset_name": "variable"})
    json.dumps(result)  # serializable as is
    assert [d["label"] for d in result["designs"]] == ["paged", "contiguous"]
    assert result["designs"][1]["timeline"]["num_reserved_tokens"] == [64, 64, 0]
    assert result["designs"][0]["output_tokens_per_step"] == 2.0
    assert result["ratios"]["contiguous"]["max_requests_in_flight"] == 2.0
    assert "timeline" not in compare_result_json([paged], [], {}, include_samples=False)["designs"][0]


def test_sweep_point_waste_and_block_table():
    paged, _ = make_pair()
    p = sweep_point(paged, max_num_seqs=8, max_model_len=30)
    assert p.mean_wasted_tokens == pytest.approx((2 + 2) / 2)
    assert p.mean_wasted_fraction == pytest.approx((2 / 32 + 2 / 16) / 2)
    assert p.mean_block_table_entries == pytest.approx(6.0)
    assert p.block_table_bytes == 8 * 8 * 4  # 8 rows of ceil(30 / 4) int32 ids
    table = format_sweep_table([p])
    assert table.splitlines()[2].split()[:2] == ["4", "16"]
