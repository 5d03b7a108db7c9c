"""Paged KV cache with continuous batching vs the traditional design, in one engine.

Both designs run the same model, attention kernels, workload and KV budget; only two things
change. ``paged`` is pagellm: blocks are taken as tokens arrive, requests join the batch every
step. ``contiguous`` is the pre-PagedAttention design: each request reserves one contiguous run
of blocks for its maximum length at admission (``ContiguousKVCacheManager``) and the scheduler
only starts a new batch once the previous one has fully drained (static batching).

The model is loaded once; each design gets a fresh ``EngineCore`` (cache, scheduler, runner)
around it (``LLMEngine.rebuild_core``), so no state leaks from one run into the next. After
every engine step the KV cache is sampled (``kv_utilization``) for the utilization figures and charts.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
from tqdm.auto import tqdm

from pagellm.bench.baseline import RESERVE_MODES, ContiguousKVCacheManager, StaticBatchScheduler
from pagellm.bench.kv_utilization import KVUsageSample, UtilizationSummary, sample_kv_usage, summarize
from pagellm.bench.sample_request import SampleRequest
from pagellm.engine.engine_core import EngineCore
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.output_processor import RequestOutputKind
from pagellm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

BLOCK_TABLE_ENTRY_BYTES = 4  # int32 block ids in the runner's block table
_SHORT_RESERVE = {"max_model_len": "max-len", "max_tokens": "max-tokens"}


def bench_sampling_params(output_len: int) -> SamplingParams:
    """Exactly ``output_len`` tokens, sampled as vLLM's benchmarks sample (temperature 1)."""
    return SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=1.0, top_p=1.0)


@dataclass
class DesignResult:
    label: str
    kv_layout: str
    reserve: Optional[str]  # contiguous only: what each reservation covers
    block_size: int
    num_blocks: int
    num_requests: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    mean_latency_ms: float
    p99_latency_ms: float
    mean_ttft_ms: float
    p99_ttft_ms: float
    num_preemptions: int
    num_steps: int
    utilization: UtilizationSummary
    samples: list[KVUsageSample] = field(repr=False, default_factory=list)

    @property
    def kv_budget_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def output_tokens_per_step(self) -> float:
        return self.total_output_tokens / self.num_steps if self.num_steps else 0.0

    def to_json(self, include_samples: bool = True) -> dict[str, Any]:
        out = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("samples", "utilization")}
        out["kv_budget_tokens"] = self.kv_budget_tokens
        out["output_tokens_per_step"] = self.output_tokens_per_step
        out["utilization"] = dataclasses.asdict(self.utilization)
        if include_samples:
            # Column lists rather than one dict per step: a long run has tens of thousands.
            out["timeline"] = {
                "time_s": [round(s.time_s, 4) for s in self.samples],
                "num_running": [s.num_running for s in self.samples],
                "num_waiting": [s.num_waiting for s in self.samples],
                "num_held_tokens": [s.num_held_tokens for s in self.samples],
                "num_reserved_tokens": [s.num_reserved_tokens for s in self.samples],
            }
        return out


def install_core(engine: LLMEngine, layout: str, reserve: Optional[str] = None, **overrides: Any) -> EngineCore:
    """Gives ``engine`` a fresh core of one design with ``overrides`` applied to its config."""
    config = dataclasses.replace(engine.config, **overrides)
    if layout == "paged":
        return engine.rebuild_core(config)
    if layout != "contiguous":
        raise ValueError(f"layout must be 'paged' or 'contiguous', got {layout!r}")
    if reserve not in RESERVE_MODES:
        raise ValueError(f"reserve must be one of {RESERVE_MODES}, got {reserve!r}")
    core = engine.rebuild_core(config, kv_cache_manager="contiguous", scheduler_cls=StaticBatchScheduler)
    core.kv_cache_manager.reserve = reserve
    return core


def warm_up(engine: LLMEngine, num_requests: int = 2, prompt_len: int = 16, output_len: int = 4) -> None:
    """Runs a tiny batch so one-time costs (kernel builds, allocator growth) stay out of timings."""
    params = bench_sampling_params(output_len)
    for i in range(num_requests):
        engine.add_request(engine.next_request_id(), {"prompt_token_ids": [100 + i] * prompt_len}, params)
    while engine.has_unfinished_requests():
        engine.step()


def run_workload(
    engine: LLMEngine,
    samples: Sequence[SampleRequest],
    label: str,
    use_tqdm: bool = True,
) -> DesignResult:
    """Sends every sample at once, steps the engine dry and measures it."""
    kv_cache_manager = engine.core.kv_cache_manager
    contiguous = isinstance(kv_cache_manager, ContiguousKVCacheManager)
    block_size = engine.config.block_size
    preemptions_before = engine.stats().scheduler.num_preemptions
    latencies: list[float] = []
    ttfts: list[float] = []
    usage: list[KVUsageSample] = []
    weights: list[float] = []
    bar = tqdm(total=len(samples), desc=label, disable=not use_tqdm, dynamic_ncols=True)
    t0 = time.perf_counter()
    arrival = time.monotonic()
    for s in samples:
        engine.add_request(
            engine.next_request_id(),
            {"prompt_token_ids": s.prompt_token_ids},
            bench_sampling_params(s.output_len),
            RequestOutputKind.FINAL_ONLY,
            arrival_time=arrival,
        )
    num_steps = 0
    prev = t0
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    m = output.metrics
                    latencies.append(m.finished_time - m.arrival_time)
                    ttfts.append(m.first_token_time - m.arrival_time)
                    bar.update(1)
            now = time.perf_counter()
            num_steps += 1
            usage.append(sample_kv_usage(engine.stats().scheduler, block_size, now - t0))
            # Each sample stands for the step that produced it, so means are over wall time.
            weights.append(now - prev)
            prev = now
    finally:
        bar.close()
    duration = time.perf_counter() - t0
    total_in = sum(s.prompt_len for s in samples)
    total_out = sum(s.output_len for s in samples)
    lat = np.asarray(latencies) * 1000
    ttft = np.asarray(ttfts) * 1000
    return DesignResult(
        label=label,
        kv_layout="contiguous" if contiguous else "paged",
        reserve=kv_cache_manager.reserve if contiguous else None,
        block_size=block_size,
        num_blocks=kv_cache_manager.num_blocks,
        num_requests=len(samples),
        duration_s=duration,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(samples) / duration,
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        mean_latency_ms=float(lat.mean()),
        p99_latency_ms=float(np.percentile(lat, 99)),
        mean_ttft_ms=float(ttft.mean()),
        p99_ttft_ms=float(np.percentile(ttft, 99)),
        num_preemptions=engine.stats().scheduler.num_preemptions - preemptions_before,
        num_steps=num_steps,
        utilization=summarize(usage, weights),
        samples=usage,
    )


@dataclass
class SweepPoint:
    """The paged design at one block size, same KV budget in tokens."""

    block_size: int
    num_blocks: int
    mean_utilization: float
    # Reserved but unwritten tokens: the unfilled tails of last blocks (the paged design's only waste).
    mean_wasted_tokens: float
    mean_wasted_fraction: float
    mean_block_table_entries: float  # block ids the attention kernels walk per step
    block_table_bytes: int  # the runner's whole table: max_num_seqs x blocks per max_model_len
    max_requests_in_flight: int
    output_throughput: float
    mean_latency_ms: float
    num_preemptions: int


def sweep_point(result: DesignResult, max_num_seqs: int, max_model_len: int) -> SweepPoint:
    u = result.utilization
    blocks_per_seq = -(-max_model_len // result.block_size)
    busy = [s for s in result.samples if s.num_reserved_tokens]
    wasted_fraction = float(np.mean([s.num_wasted_tokens / s.num_reserved_tokens for s in busy])) if busy else 0.0
    return SweepPoint(
        block_size=result.block_size,
        num_blocks=result.num_blocks,
        mean_utilization=u.mean_utilization,
        mean_wasted_tokens=u.mean_wasted_tokens,
        mean_wasted_fraction=wasted_fraction,
        mean_block_table_entries=u.mean_block_table_entries,
        block_table_bytes=max_num_seqs * blocks_per_seq * BLOCK_TABLE_ENTRY_BYTES,
        max_requests_in_flight=u.max_requests_in_flight,
        output_throughput=result.output_throughput,
        mean_latency_ms=result.mean_latency_ms,
        num_preemptions=result.num_preemptions,
    )


def run_compare(
    engine: LLMEngine,
    samples: Sequence[SampleRequest],
    budget_tokens: int,
    block_size: int,
    reserve_modes: Sequence[str] = ("max_model_len",),
    sweep_block_sizes: Sequence[int] = (),
    use_tqdm: bool = True,
    include_contiguous: bool = True,
) -> dict[str, Any]:
    """Paged, then contiguous per reservation mode, then the paged block-size sweep."""
    if budget_tokens < block_size:
        raise ValueError(f"a KV budget of {budget_tokens} tokens holds no block of {block_size}")
    designs: list[DesignResult] = []
    install_core(engine, "paged", block_size=block_size, num_kv_blocks=budget_tokens // block_size)
    warm_up(engine)
    designs.append(run_workload(engine, samples, "paged", use_tqdm=use_tqdm))
    for mode in reserve_modes if include_contiguous else ():
        install_core(engine, "contiguous", mode, block_size=block_size, num_kv_blocks=budget_tokens // block_size)
        label = "contiguous" if len(reserve_modes) == 1 else f"contig {_SHORT_RESERVE[mode]}"
        designs.append(run_workload(engine, samples, label, use_tqdm=use_tqdm))
    sweep: list[SweepPoint] = []
    for bs in sweep_block_sizes:
        if bs == block_size:
            result = designs[0]  # already measured
        else:
            install_core(engine, "paged", block_size=bs, num_kv_blocks=max(1, budget_tokens // bs))
            warm_up(engine)
            result = run_workload(engine, samples, f"paged, block size {bs}", use_tqdm=use_tqdm)
        sweep.append(sweep_point(result, engine.config.max_num_seqs, engine.max_model_len))
    return {"designs": designs, "sweep": sweep}


# ---- reporting --------------------------------------------------------------------------


def _ratio(a: float, b: float) -> Optional[float]:
    return a / b if b else None


def ratios(paged: DesignResult, other: DesignResult) -> dict[str, Optional[float]]:
    """paged / other for the headline figures (latency: other / paged, so > 1 means paged wins)."""
    return {
        "kv_utilization": _ratio(paged.utilization.mean_utilization, other.utilization.mean_utilization),
        "max_requests_in_flight": _ratio(paged.utilization.max_requests_in_flight, other.utilization.max_requests_in_flight),
        "mean_requests_in_flight": _ratio(
            paged.utilization.mean_requests_in_flight, other.utilization.mean_requests_in_flight
        ),
        "output_throughput": _ratio(paged.output_throughput, other.output_throughput),
        # Steps do not depend on how busy the machine is, unlike the wall-clock figures.
        "output_tokens_per_step": _ratio(paged.output_tokens_per_step, other.output_tokens_per_step),
        "mean_latency_speedup": _ratio(other.mean_latency_ms, paged.mean_latency_ms),
        "p99_latency_speedup": _ratio(other.p99_latency_ms, paged.p99_latency_ms),
    }


def format_compare_table(designs: Sequence[DesignResult]) -> str:
    paged, others = designs[0], designs[1:]
    width = max(14, 2 + max(len(d.label) for d in designs))
    header = f"{'':<34}" + "".join(f"{d.label:>{width}}" for d in designs)
    header += "".join(f"{'ratio' if len(others) == 1 else 'ratio ' + d.label.split()[-1]:>{width}}" for d in others)
    rows: list[tuple[str, Any, str, Optional[str]]] = [
        # label, getter, format, ratio key
        ("KV budget (tokens)", lambda d: d.kv_budget_tokens, "d", None),
        ("KV utilization, mean (%)", lambda d: 100 * d.utilization.mean_utilization, ".1f", "kv_utilization"),
        ("KV utilization, peak (%)", lambda d: 100 * d.utilization.peak_utilization, ".1f", None),
        ("KV occupancy of budget, mean (%)", lambda d: 100 * d.utilization.mean_occupancy, ".1f", None),
        ("Requests in flight, max", lambda d: d.utilization.max_requests_in_flight, "d", "max_requests_in_flight"),
        ("Requests in flight, mean", lambda d: d.utilization.mean_requests_in_flight, ".1f", "mean_requests_in_flight"),
        ("Output throughput (tok/s)", lambda d: d.output_throughput, ".2f", "output_throughput"),
        ("Request throughput (req/s)", lambda d: d.request_throughput, ".3f", None),
        ("Engine steps", lambda d: d.num_steps, "d", None),
        ("Output tokens per step", lambda d: d.output_tokens_per_step, ".2f", "output_tokens_per_step"),
        ("Mean latency (s)", lambda d: d.mean_latency_ms / 1000, ".2f", "mean_latency_speedup"),
        ("P99 latency (s)", lambda d: d.p99_latency_ms / 1000, ".2f", "p99_latency_speedup"),
        ("Mean TTFT (s)", lambda d: d.mean_ttft_ms / 1000, ".2f", None),
        ("Benchmark duration (s)", lambda d: d.duration_s, ".2f", None),
        ("Preemptions", lambda d: d.num_preemptions, "d", None),
    ]
    title = " Paged vs contiguous KV cache "
    total_width = len(header)
    lines = ["{s:{c}^{n}}".format(s=title, n=total_width, c="="), header]
    all_ratios = [ratios(paged, d) for d in others]
    for label, get, fmt, key in rows:
        line = f"{label:<34}" + "".join(f"{format(get(d), fmt):>{width}}" for d in designs)
        for r in all_ratios:
            value = r.get(key) if key else None
            line += f"{format(value, '.2f') + 'x':>{width}}" if value is not None else f"{'':>{width}}"
        lines.append(line)
    if others:
        lines.append("ratio: paged / other; for latencies other / paged, so > 1 always means paged is better")
    lines.append("=" * total_width)
    return "\n".join(lines)


def format_sweep_table(points: Sequence[SweepPoint]) -> str:
    header = (
        f"{'block':>6} {'blocks':>7} {'util %':>7} {'waste tok':>10} {'waste %':>8} "
        f"{'table ids':>10} {'table KiB':>10} {'max reqs':>9} {'tok/s':>8} {'mean lat s':>11} {'preempt':>8}"
    )
    lines = ["{s:{c}^{n}}".format(s=" Paged block-size sweep (same KV budget) ", n=len(header), c="="), header]
    for p in points:
        lines.append(
            f"{p.block_size:>6} {p.num_blocks:>7} {100 * p.mean_utilization:>7.1f} {p.mean_wasted_tokens:>10.0f} "
            f"{100 * p.mean_wasted_fraction:>8.1f} {p.mean_block_table_entries:>10.0f} {p.block_table_bytes / 1024:>10.1f} "
            f"{p.max_requests_in_flight:>9d} {p.output_throughput:>8.2f} {p.mean_latency_ms / 1000:>11.2f} {p.num_preemptions:>8d}"
        )
    lines.append("=" * len(header))
    return "\n".join(lines)


def compare_result_json(
    designs: Sequence[DesignResult], sweep: Sequence[SweepPoint], config: dict[str, Any], include_samples: bool = True
) -> dict[str, Any]:
    paged = designs[0]
    return {
        "config": config,
        "designs": [d.to_json(include_samples) for d in designs],
        "ratios": {d.label: ratios(paged, d) for d in designs[1:]},
        "block_size_sweep": [dataclasses.asdict(p) for p in sweep],
    }
