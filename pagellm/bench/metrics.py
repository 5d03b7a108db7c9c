"""Serving-benchmark arithmetic, defined exactly as vLLM's ``vllm bench serve`` defines it.

Per request, measured on the client from the moment the request is sent:
  * TTFT: time until the first streamed chunk that carries a choice;
  * ITL: the gap between each later such chunk and the one before it (one entry per chunk, so
    a chunk holding several tokens is one long gap, as vLLM counts it);
  * E2EL (``latency``): time until the last such chunk;
  * TPOT: ``(E2EL - TTFT) / (output_len - 1)``, only for requests with more than one output token.
Output length is the server's ``usage.completion_tokens`` when it reports one, else the number
of chunks received. Aggregates are numpy's mean / median / std / percentile (linear
interpolation) in milliseconds, and a metric with no samples reads 0, as in vLLM. Throughputs
divide by the benchmark's wall duration.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


@dataclass
class RequestTrace:
    """What the client saw of one request (vLLM's ``RequestFuncOutput``). Times in seconds."""

    success: bool = False
    prompt_len: int = 0
    output_tokens: Optional[int] = None  # usage.completion_tokens, when the server sent it
    num_chunks: int = 0  # streamed chunks that carried a choice
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0  # perf_counter when sent, for peak throughput and concurrency
    generated_text: str = ""
    error: str = ""

    @property
    def output_len(self) -> int:
        return self.output_tokens if self.output_tokens else self.num_chunks


@dataclass
class MetricStats:
    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: list[tuple[float, float]]


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    stats: dict[str, MetricStats]  # keyed by METRIC_NAMES
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    output_lens: list[int]  # per request, 0 for failed ones


def metric_stats(values_s: Sequence[float], percentiles: Sequence[float]) -> MetricStats:
    """numpy statistics of ``values_s`` (seconds) in milliseconds; zeros when there are none."""
    values = np.asarray(values_s if len(values_s) else [0.0], dtype=np.float64)
    return MetricStats(
        mean_ms=float(np.mean(values) * 1000),
        median_ms=float(np.median(values) * 1000),
        std_ms=float(np.std(values) * 1000),
        percentiles_ms=[(float(p), float(np.percentile(values, p) * 1000)) for p in percentiles],
    )


def tpot_of(trace: RequestTrace) -> Optional[float]:
    n = trace.output_len
    return (trace.latency - trace.ttft) / (n - 1) if n > 1 else None


def peak_concurrency(traces: Sequence[RequestTrace]) -> int:
    """Most requests in flight at once over half-open [start, start + latency) intervals."""
    events = []
    for t in traces:
        events.append((t.start_time, 1))
        events.append((t.start_time + t.latency, -1))
    events.sort()  # at equal times -1 sorts first: one leaving as another arrives is not overlap
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def peak_output_tokens_per_s(traces: Sequence[RequestTrace]) -> float:
    """Most chunks received within one wall-clock second (one-second buckets from the first send)."""
    if not traces:
        return 0.0
    t0 = min(t.start_time for t in traces)
    t_end = max(t.start_time + t.latency for t in traces)
    buckets = np.zeros(int(np.ceil(t_end - t0)) + 1)
    for t in traces:
        times = t.start_time + t.ttft + np.concatenate([[0.0], np.cumsum(t.itl)])
        idx = (times - t0).astype(np.int64)
        np.add.at(buckets, idx[(idx >= 0) & (idx < buckets.size)], 1)
    return float(buckets.max())


def calculate_metrics(
    traces: Sequence[RequestTrace], duration_s: float, percentiles: Sequence[float] = (99,)
) -> BenchmarkMetrics:
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    ok = [t for t in traces if t.success]
    output_lens = [t.output_len if t.success else 0 for t in traces]
    total_input = sum(t.prompt_len for t in ok)
    total_output = sum(output_lens)
    values: dict[str, list[float]] = {
        "ttft": [t.ttft for t in ok],
        "tpot": [v for v in map(tpot_of, ok) if v is not None],
        "itl": [gap for t in ok for gap in t.itl],
        "e2el": [t.latency for t in ok],
    }
    return BenchmarkMetrics(
        completed=len(ok),
        failed=len(traces) - len(ok),
        total_input=total_input,
        total_output=total_output,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_output / duration_s,
        total_token_throughput=(total_input + total_output) / duration_s,
        stats={name: metric_stats(v, percentiles) for name, v in values.items()},
        max_output_tokens_per_s=peak_output_tokens_per_s(ok),
        max_concurrent_requests=peak_concurrency(ok),
        output_lens=output_lens,
    )


def percentile_key(p: float) -> str:
    """99 -> 'p99', 99.9 -> 'p99.9', as vLLM names result keys."""
    return f"p{int(p)}" if int(p) == p else f"p{p}"


def result_dict(
    metrics: BenchmarkMetrics,
    traces: Sequence[RequestTrace],
    duration_s: float,
    metric_names: Sequence[str] = METRIC_NAMES,
) -> dict:
    """The JSON result, with vLLM's key names (``mean_ttft_ms``, ``p99_itl_ms``, ...)."""
    result = {
        "duration": duration_s,
        "completed": metrics.completed,
        "failed": metrics.failed,
        "total_input_tokens": metrics.total_input,
        "total_output_tokens": metrics.total_output,
        "request_throughput": metrics.request_throughput,
        "output_throughput": metrics.output_throughput,
        "total_token_throughput": metrics.total_token_throughput,
        "max_output_tokens_per_s": metrics.max_output_tokens_per_s,
        "max_concurrent_requests": metrics.max_concurrent_requests,
        "input_lens": [t.prompt_len for t in traces],
        "output_lens": metrics.output_lens,
        "ttfts": [t.ttft for t in traces],
        "itls": [t.itl for t in traces],
        "latencies": [t.latency for t in traces],
        "start_times": [t.start_time for t in traces],
        "errors": [t.error for t in traces],
    }
    for name in metric_names:
        s = metrics.stats[name]
        result[f"mean_{name}_ms"] = s.mean_ms
        result[f"median_{name}_ms"] = s.median_ms
        result[f"std_{name}_ms"] = s.std_ms
        for p, value in s.percentiles_ms:
            result[f"{percentile_key(p)}_{name}_ms"] = value
    return result


def _row(label: str, value, fmt: str = "") -> str:
    return f"{label:<40} {format(value, fmt):<10}"


def format_serving_table(
    metrics: BenchmarkMetrics,
    duration_s: float,
    max_concurrency: Optional[int] = None,
    request_rate: float = float("inf"),
    metric_names: Sequence[str] = METRIC_NAMES,
) -> str:
    """The result table with vLLM's labels, so outputs of the two tools can be diffed."""
    lines = [
        "{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="),
        _row("Successful requests:", metrics.completed),
        _row("Failed requests:", metrics.failed),
    ]
    if max_concurrency is not None:
        lines.append(_row("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        lines.append(_row("Request rate configured (RPS):", request_rate, ".2f"))
    lines += [
        _row("Benchmark duration (s):", duration_s, ".2f"),
        _row("Total input tokens:", metrics.total_input),
        _row("Total generated tokens:", metrics.total_output),
        _row("Request throughput (req/s):", metrics.request_throughput, ".2f"),
        _row("Output token throughput (tok/s):", metrics.output_throughput, ".2f"),
        _row("Peak output token throughput (tok/s):", metrics.max_output_tokens_per_s, ".2f"),
        _row("Peak concurrent requests:", float(metrics.max_concurrent_requests), ".2f"),
        _row("Total token throughput (tok/s):", metrics.total_token_throughput, ".2f"),
    ]
    for name in metric_names:
        short, header = METRIC_TITLES[name]
        s = metrics.stats[name]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        lines.append(_row(f"Mean {short} (ms):", s.mean_ms, ".2f"))
        lines.append(_row(f"Median {short} (ms):", s.median_ms, ".2f"))
        for p, value in s.percentiles_ms:
            lines.append(_row(f"{percentile_key(p).upper()} {short} (ms):", value, ".2f"))
    lines.append("=" * 50)
    return "\n".join(lines)


def parse_percentiles(text: str) -> list[float]:
    """'50,90,99' -> [50.0, 90.0, 99.0], each within [0, 100]."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"percentiles must be comma-separated numbers, got {text!r}") from None
    if not values or any(not 0 <= v <= 100 for v in values):
        raise ValueError(f"percentiles must be numbers in [0, 100], got {text!r}")
    return values


def parse_metric_names(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in METRIC_NAMES]
    if bad or not names:
        raise ValueError(f"unknown metrics {bad or text!r}; choose from {','.join(METRIC_NAMES)}")
    return names
