import pytest

from pagellm.bench.metrics import (
    RequestTrace,
    calculate_metrics,
    format_serving_table,
    parse_metric_names,
    parse_percentiles,
    peak_concurrency,
    result_dict,
    tpot_of,
)

approx = pytest.approx


def hand_made_traces() -> list[RequestTrace]:
    return [
        # 4 tokens (from usage) in 4 chunks: TTFT 100 ms, then gaps of 20, 30 and 50 ms.
        RequestTrace(
            success=True, prompt_len=10, output_tokens=4, num_chunks=4, ttft=0.1, itl=[0.02, 0.03, 0.05], latency=0.2, start_time=0.0
        ),
        # No usage reported: the 2 chunks received count as 2 tokens.
        RequestTrace(success=True, prompt_len=20, output_tokens=None, num_chunks=2, ttft=0.3, itl=[0.1], latency=0.4, start_time=0.05),
        # A single token: no TPOT, no ITL.
        RequestTrace(success=True, prompt_len=5, output_tokens=1, num_chunks=1, ttft=0.5, itl=[], latency=0.5, start_time=0.1),
        RequestTrace(success=False, prompt_len=7, error="HTTP 500"),
    ]


def test_per_request_tpot_definition():
    a, b, c, _ = hand_made_traces()
    assert tpot_of(a) == approx((0.2 - 0.1) / 3)
    assert tpot_of(b) == approx(0.1 / 1)
    assert tpot_of(c) is None


def test_aggregates_on_hand_made_trace():
    m = calculate_metrics(hand_made_traces(), duration_s=2.0, percentiles=[50, 99])
    assert m.completed == 3 and m.failed == 1
    assert m.total_input == 35  # failed requests' prompts are not counted
    assert m.total_output == 7
    assert m.output_lens == [4, 2, 1, 0]
    assert m.request_throughput == approx(1.5)
    assert m.output_throughput == approx(3.5)
    assert m.total_token_throughput == approx(21.0)

    ttft = m.stats["ttft"]
    assert ttft.mean_ms == approx(300.0)
    assert ttft.median_ms == approx(300.0)
    assert ttft.percentiles_ms == [(50.0, approx(300.0)), (99.0, approx(496.0))]  # 0.3 + 0.98 * 0.2, linear
    tpot = m.stats["tpot"]
    assert tpot.mean_ms == approx((100 / 3 + 100) / 2)
    assert tpot.percentiles_ms[1] == (99.0, approx(100 / 3 + 0.99 * (100 - 100 / 3)))
    itl = m.stats["itl"]  # all gaps of all requests pooled: 20, 30, 50, 100 ms
    assert itl.mean_ms == approx(50.0)
    assert itl.median_ms == approx(40.0)
    assert itl.percentiles_ms[1] == (99.0, approx(98.5))  # 50 + 0.97 * 50
    assert itl.std_ms == approx(30.822070, rel=1e-6)  # population std, as numpy's default
    e2el = m.stats["e2el"]
    assert e2el.mean_ms == approx(1100 / 3)
    assert e2el.median_ms == approx(400.0)
    assert m.max_concurrent_requests == 3  # all three overlap at t = 0.1
    assert m.max_output_tokens_per_s == 7  # every chunk lands within the first second


def test_peak_concurrency_half_open_intervals():
    back_to_back = [RequestTrace(start_time=0.0, latency=1.0), RequestTrace(start_time=1.0, latency=1.0)]
    assert peak_concurrency(back_to_back) == 1


def test_all_failed_reads_zeros():
    m = calculate_metrics([RequestTrace(success=False, prompt_len=3)], duration_s=1.0)
    assert m.completed == 0 and m.failed == 1 and m.total_output == 0
    assert m.stats["ttft"].mean_ms == 0.0 and m.stats["e2el"].percentiles_ms == [(99.0, 0.0)]
    with pytest.raises(ValueError):
        calculate_metrics([], duration_s=0.0)


def test_result_keys_and_table_labels_match_vllm():
    traces = hand_made_traces()
    m = calculate_metrics(traces, 2.0, [99])
    result = result_dict(m, traces, 2.0)
    for key in (
        "completed",
        "failed",
        "duration",
        "request_throughput",
        "output_throughput",
        "total_token_throughput",
        "total_input_tokens",
        "total_output_tokens",
        "mean_ttft_ms",
        "median_ttft_ms",
        "std_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "median_tpot_ms",
        "p99_tpot_ms",
        "mean_itl_ms",
        "median_itl_ms",
        "p99_itl_ms",
        "mean_e2el_ms",
        "median_e2el_ms",
        "p99_e2el_ms",
        "input_lens",
        "output_lens",
        "ttfts",
        "itls",
        "latencies",
        "errors",
    ):
        assert key in result, key
    assert result["completed"] == 3 and result["mean_itl_ms"] == approx(50.0)
    assert result["errors"][3] == "HTTP 500"
    table = format_serving_table(m, 2.0, max_concurrency=4, request_rate=2.0)
    for label in (
        "Successful requests:",
        "Failed requests:",
        "Maximum request concurrency:",
        "Request rate configured (RPS):",
        "Benchmark duration (s):",
        "Total input tokens:",
        "Total generated tokens:",
        "Request throughput (req/s):",
        "Output token throughput (tok/s):",
        "Total token throughput (tok/s):",
        "Mean TTFT (ms):",
        "Median TTFT (ms):",
        "P99 TTFT (ms):",
        "Mean TPOT (ms):",
        "Mean ITL (ms):",
        "P99 E2EL (ms):",
    ):
        assert label in table, label
    line = next(x for x in table.splitlines() if x.startswith("Mean TTFT (ms):"))
    assert line.split()[-1] == "300.00"
    assert "Request rate configured" not in format_serving_table(m, 2.0)  # inf rate: not printed


def test_percentile_and_metric_flags():
    assert parse_percentiles("50, 90,99.9") == [50.0, 90.0, 99.9]
    assert parse_metric_names("ttft,e2el") == ["ttft", "e2el"]
    for bad in ("", "101", "x"):
        with pytest.raises(ValueError):
            parse_percentiles(bad)
    with pytest.raises(ValueError):
        parse_metric_names("ttft,foo")
    m = calculate_metrics(hand_made_traces(), 2.0, [99.9])
    assert "p99.9_ttft_ms" in result_dict(m, hand_made_traces(), 2.0)
