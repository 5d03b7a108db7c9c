"""Prometheus metrics and the periodic stats log line, named after vLLM's with a ``pagellm:`` prefix.

``EngineMetrics`` is the ``StatLogger`` of ``AsyncLLM``: its methods run on the engine thread
(prometheus_client's metrics are thread-safe). Each app gets its own ``CollectorRegistry``, so
several servers can live in one process (tests do this).
"""
from __future__ import annotations

import logging
import time
from typing import Optional

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagellm.core.scheduler import SchedulerStats
from pagellm.core.spec_decode_stats import SpecDecodingStats
from pagellm.engine.stats import EngineStats
from pagellm.outputs import EmbeddingRequestOutput, RequestOutput
from pagellm.plan.memory_plan import MemoryPlan

logger = logging.getLogger(__name__)

# The *_created series double the output and nobody reads them.
prometheus_client.disable_created_metrics()

# Buckets as vLLM's, so dashboards built for vLLM read these unchanged.
TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]
FINISHED_REASONS = ("stop", "length", "abort", "error")


class EngineMetrics:
    def __init__(self, model_name: str, registry: Optional[CollectorRegistry] = None, log_interval_s: float = 5.0) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.log_interval_s = log_interval_s
        reg, labels, name = self.registry, ["model_name"], model_name

        def gauge(metric: str, doc: str):
            return Gauge(metric, doc, labels, registry=reg).labels(name)

        def counter(metric: str, doc: str):
            return Counter(metric, doc, labels, registry=reg).labels(name)

        def histogram(metric: str, doc: str, buckets: list[float]):
            return Histogram(metric, doc, labels, buckets=buckets, registry=reg).labels(name)

        self.num_requests_running = gauge("pagellm:num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge("pagellm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_cache_usage = gauge("pagellm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        # The memory plan, set once at start-up (pagellm.models.memory_plan).
        self.weight_bytes = gauge("pagellm:model_weight_bytes", "Bytes the model's weights hold resident.")
        self.checkpoint_bytes = gauge("pagellm:model_checkpoint_bytes", "Bytes of the weights in the checkpoint files.")
        self.kv_cache_bytes = gauge("pagellm:kv_cache_bytes", "Bytes of the KV cache.")
        self.kv_cache_tokens = gauge("pagellm:kv_cache_tokens", "Tokens the KV cache holds.")
        self.activation_bytes = gauge("pagellm:activation_reserve_bytes", "Bytes planned for one step's activations.")
        # A hybrid model's recurrent state (pagellm.core.state_cache): slots carved from the KV cache's bytes.
        self.state_cache_bytes = gauge("pagellm:state_cache_bytes", "Bytes of the recurrent state slots (part of pagellm:kv_cache_bytes).")
        self.state_slots = gauge("pagellm:state_slots", "Recurrent state slots (live requests' and prefix-cache checkpoints).")
        self.state_slots_live = gauge("pagellm:state_slots_live", "Recurrent state slots held by running requests.")
        self.state_checkpoints = gauge("pagellm:state_checkpoints", "Saved recurrent states that a prefix-cache hit can resume from.")
        self.state_checkpoint_bytes = gauge("pagellm:state_checkpoint_bytes", "Bytes held by saved recurrent states (checkpoints).")
        self.state_checkpoints_saved = counter("pagellm:state_checkpoints_saved", "Recurrent states saved at block boundaries.")
        self.state_checkpoints_restored = counter("pagellm:state_checkpoints_restored", "Prefix-cache hits resumed from a saved state.")
        self._state_slot_bytes = 0
        self._seen_saved = self._seen_restored = 0
        # vLLM's cache_config_info: 1, with what the cache holds as a label.
        self._cache_config_info = Gauge(
            "pagellm:cache_config_info", "Information of the KV cache configuration.", ["model_name", "cache_dtype"], registry=reg
        )
        self._model_name = name
        self.prefix_cache_queries = counter("pagellm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter("pagellm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.num_preemptions = counter("pagellm:num_preemptions", "Cumulative number of preemptions from the engine.")
        self.prompt_tokens = counter("pagellm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("pagellm:generation_tokens", "Number of generation tokens processed.")
        request_success = Counter(
            "pagellm:request_success", "Count of finished requests by finish reason.", ["model_name", "finished_reason"], registry=reg
        )
        self.request_success = {reason: request_success.labels(name, reason) for reason in FINISHED_REASONS}
        self.time_to_first_token = histogram(
            "pagellm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.inter_token_latency = histogram(
            "pagellm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "pagellm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.request_queue_time = histogram(
            "pagellm:request_queue_time_seconds",
            "Histogram of time spent waiting before first scheduled, in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        # Totals since the last log line.
        self._last_log_time = time.monotonic()
        self._interval_prompt_tokens = 0
        self._interval_generation_tokens = 0
        self._interval_queries = 0
        self._interval_hits = 0
        # The engine's counters are cumulative; the Prometheus counters advance by the difference.
        self._seen_queries = self._seen_hits = self._seen_preemptions = 0
        # Speculative decoding's counters, made on the first step of an engine that speculates.
        self._spec: Optional[dict] = None
        self._tier: Optional[dict] = None  # the offloading tier's series, made when it first reports
        self._tier_seen: dict[str, float] = {}
        self._seen_spec: Optional[SpecDecodingStats] = None
        self._interval_spec: Optional[SpecDecodingStats] = None

    # -- StatLogger, called on the engine thread ------------------------------------------------------

    def record_memory_plan(self, plan: MemoryPlan) -> None:
        self.weight_bytes.set(plan.weight_bytes)
        self.checkpoint_bytes.set(plan.checkpoint_bytes)
        self.kv_cache_bytes.set(plan.kv_cache_bytes)
        self.kv_cache_tokens.set(plan.kv_cache_tokens)
        self.activation_bytes.set(plan.activation_bytes)
        self.state_cache_bytes.set(plan.state_bytes)
        self.state_slots.set(plan.num_state_slots)
        self._state_slot_bytes = plan.state_bytes // plan.num_state_slots if plan.num_state_slots else 0
        self._cache_config_info.labels(self._model_name, plan.kv_cache_dtype or "unknown").set(1)

    def record_step(self, engine_stats: EngineStats, now: float) -> None:
        stats = engine_stats.scheduler
        self.num_requests_running.set(stats.num_running_reqs)
        self.num_requests_waiting.set(stats.num_waiting_reqs)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        new_queries = stats.prefix_cache_queries - self._seen_queries
        new_hits = stats.prefix_cache_hits - self._seen_hits
        self.prefix_cache_queries.inc(new_queries)
        self.prefix_cache_hits.inc(new_hits)
        self.num_preemptions.inc(stats.num_preemptions - self._seen_preemptions)
        self._seen_queries, self._seen_hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        self._seen_preemptions = stats.num_preemptions
        self._interval_queries += new_queries
        self._interval_hits += new_hits
        if stats.spec_decoding is not None:
            self._record_spec_decoding(stats.spec_decoding)
        state = stats.state_cache
        if state is not None:
            self.state_slots_live.set(state.num_live)
            self.state_checkpoints.set(state.num_checkpoints)
            self.state_checkpoint_bytes.set(state.num_checkpoints * self._state_slot_bytes)
            self.state_checkpoints_saved.inc(state.num_checkpoints_written - self._seen_saved)
            self.state_checkpoints_restored.inc(state.num_checkpoints_restored - self._seen_restored)
            self._seen_saved, self._seen_restored = state.num_checkpoints_written, state.num_checkpoints_restored
        if stats.kv_tier is not None:
            self._record_tier(stats)
        if now - self._last_log_time >= self.log_interval_s:
            busy = stats.num_running_reqs or stats.num_waiting_reqs or self._interval_generation_tokens
            if busy:
                self._log(stats, now)
            else:  # idle: start the next interval fresh rather than log zeros
                self._reset_interval(now)

    # (metric, help, where: "core" or "worker", field); cumulative counters advance by what they gained.
    _TIER_COUNTERS = (
        ("kv_tier_saves", "Prefix blocks evicted from the KV cache and saved to the offloading tier.", "core", "num_saves"),
        ("kv_tier_loads", "Requests whose prefix was loaded from the offloading tier.", "core", "num_loads"),
        ("kv_tier_blocks_loaded", "Token blocks loaded from the offloading tier.", "core", "num_blocks_loaded"),
        ("kv_tier_blocks_failed", "Token blocks whose load failed (damaged, missing): recomputed.", "core", "num_blocks_failed"),
        ("kv_tier_hit_tokens", "Prompt tokens served from the offloading tier.", "core", "num_hit_tokens"),
        ("kv_tier_state_saves", "A hybrid model's recurrent state checkpoints evicted and saved to the tier.", "core", "num_state_saves"),
        ("kv_tier_states_loaded", "Recurrent state checkpoints loaded from the tier, resumed from.", "core", "num_states_loaded"),
        ("kv_tier_states_failed", "Recurrent state loads that failed: the prefix is recomputed.", "core", "num_states_failed"),
        ("kv_tier_bytes_written", "Bytes written to the offloading tier.", "worker", "bytes_written"),
        ("kv_tier_bytes_read", "Bytes read from the offloading tier.", "worker", "bytes_read"),
        ("kv_tier_load_seconds", "Seconds loads took, from order to pages in the cache.", "worker", "load_seconds"),
        ("kv_tier_evictions", "Pages the offloading tier dropped for room (least recently used).", "worker", "num_evictions"),
        ("kv_tier_corrupt", "Damaged, truncated or foreign tier files found (treated as misses).", "worker", "num_corrupt"),
        ("kv_tier_write_errors", "Failed writes to the tier (disk full, read-only): the page is not kept.", "worker", "num_write_errors"),
        ("kv_tier_read_errors", "Failed reads from the tier: the prefix is recomputed.", "worker", "num_read_errors"),
        ("kv_tier_dropped_saves", "Saves dropped because the staging buffer was full.", "worker", "num_dropped_saves"),
    )

    def _record_tier(self, stats: SchedulerStats) -> None:
        """The offloading tier's gauges and counters (pagellm.core.kv_tier, pagellm.kv_offload)."""
        if self._tier is None:
            reg, name = self.registry, self._model_name
            self._tier = {
                metric: Counter(f"pagellm:{metric}", doc, ["model_name"], registry=reg).labels(name)
                for metric, doc, _, _ in self._TIER_COUNTERS
            }
            for metric, doc in (
                ("kv_tier_pages", "Pages the offloading tier holds."),
                ("kv_tier_used_bytes", "Bytes the offloading tier holds."),
                ("kv_tier_capacity_bytes", "The offloading tier's size (--kv-offloading-size)."),
                ("num_requests_loading", "Requests waiting for their prefix's pages from the offloading tier."),
            ):
                self._tier[metric] = Gauge(f"pagellm:{metric}", doc, ["model_name"], registry=reg).labels(name)
        sources = {"core": stats.kv_tier, "worker": stats.kv_tier_worker}
        for metric, _, where, field_name in self._TIER_COUNTERS:
            value = float(getattr(sources[where], field_name, 0) or 0)
            self._tier[metric].inc(max(0.0, value - self._tier_seen.get(metric, 0.0)))
            self._tier_seen[metric] = value
        self._tier["kv_tier_pages"].set(stats.kv_tier.num_keys)
        self._tier["kv_tier_used_bytes"].set(getattr(stats.kv_tier_worker, "bytes_used", 0) or 0)
        self._tier["kv_tier_capacity_bytes"].set(getattr(stats.kv_tier_worker, "capacity_bytes", 0) or 0)
        self._tier["num_requests_loading"].set(stats.num_loading_reqs)

    def _record_spec_decoding(self, spec: SpecDecodingStats) -> None:
        """vLLM's spec_decode_* counters, advanced by what the engine's cumulative ones gained."""
        if self._spec is None:
            reg, name = self.registry, self._model_name

            def counter(metric: str, doc: str):
                return Counter(metric, doc, ["model_name"], registry=reg).labels(name)

            per_pos = Counter(
                "pagellm:spec_decode_num_accepted_tokens_per_pos",
                "Accepted draft tokens at each draft position.",
                ["model_name", "position"],
                registry=reg,
            )
            self._spec = {
                "num_drafts": counter("pagellm:spec_decode_num_drafts", "Number of spec decoding drafts."),
                "num_draft_tokens": counter("pagellm:spec_decode_num_draft_tokens", "Number of draft tokens."),
                "num_accepted_tokens": counter("pagellm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
                "per_pos": [per_pos.labels(name, str(i)) for i in range(spec.num_spec_tokens)],
            }
            self._seen_spec = SpecDecodingStats(spec.num_spec_tokens)
            self._interval_spec = SpecDecodingStats(spec.num_spec_tokens)
        new = spec.since(self._seen_spec)
        self._spec["num_drafts"].inc(new.num_drafts)
        self._spec["num_draft_tokens"].inc(new.num_draft_tokens)
        self._spec["num_accepted_tokens"].inc(new.num_accepted_tokens)
        for counter, n in zip(self._spec["per_pos"], new.num_accepted_tokens_per_pos):
            counter.inc(n)
        self._seen_spec = spec.copy()
        self._interval_spec = self._interval_spec.plus(new)

    def record_output(self, output: RequestOutput | EmbeddingRequestOutput, now: float, inter_token_latency: Optional[float]) -> None:
        if isinstance(output, EmbeddingRequestOutput):
            self._record_embedding(output, now)
            return
        num_new_tokens = sum(len(c.token_ids) for c in output.outputs)
        metrics = output.metrics
        if num_new_tokens:
            self.generation_tokens.inc(num_new_tokens)
            self._interval_generation_tokens += num_new_tokens
            if inter_token_latency is None:  # this request's first tokens
                num_prompt_tokens = len(output.prompt_token_ids)
                self.prompt_tokens.inc(num_prompt_tokens)
                self._interval_prompt_tokens += num_prompt_tokens
                if metrics is not None:
                    self.time_to_first_token.observe((metrics.first_token_time or now) - metrics.arrival_time)
                    if metrics.first_scheduled_time is not None:
                        self.request_queue_time.observe(max(0.0, metrics.first_scheduled_time - metrics.arrival_time))
            else:
                self.inter_token_latency.observe(inter_token_latency)
        if output.finished:
            for completion in output.outputs:
                reason = completion.finish_reason if completion.finish_reason in self.request_success else "error"
                self.request_success[reason].inc()
            if metrics is not None:
                self.e2e_request_latency.observe((metrics.finished_time or now) - metrics.arrival_time)

    def _record_embedding(self, output: EmbeddingRequestOutput, now: float) -> None:
        """A pooling request's one output: its prompt tokens, and success or error."""
        num_prompt_tokens = len(output.prompt_token_ids)
        self.prompt_tokens.inc(num_prompt_tokens)
        self._interval_prompt_tokens += num_prompt_tokens
        self.request_success["stop" if output.error is None else "error"].inc()
        if output.metrics is not None:
            self.e2e_request_latency.observe((output.metrics.finished_time or now) - output.metrics.arrival_time)

    def record_aborted(self, num_requests: int) -> None:
        self.request_success["abort"].inc(num_requests)

    # -------------------------------------------------------------------------------------------------

    def _log(self, stats: SchedulerStats, now: float) -> None:
        elapsed = now - self._last_log_time
        hit_rate = self._interval_hits / self._interval_queries if self._interval_queries else 0.0
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, Running: %d reqs, "
            "Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            self._interval_prompt_tokens / elapsed,
            self._interval_generation_tokens / elapsed,
            stats.num_running_reqs,
            stats.num_waiting_reqs,
            stats.kv_cache_usage * 100,
            hit_rate * 100,
        )
        spec = self._interval_spec
        if spec is not None and spec.num_drafts:
            per_pos = ", ".join(f"{n / spec.num_drafts:.3f}" for n in spec.num_accepted_tokens_per_pos)
            logger.info(
                "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
                "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
                "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
                spec.mean_acceptance_length,
                spec.num_accepted_tokens / elapsed,
                spec.num_draft_tokens / elapsed,
                spec.num_accepted_tokens,
                spec.num_draft_tokens,
                per_pos,
                spec.acceptance_rate * 100,
            )
        self._reset_interval(now)

    def _reset_interval(self, now: float) -> None:
        self._last_log_time = now
        self._interval_prompt_tokens = self._interval_generation_tokens = 0
        self._interval_queries = self._interval_hits = 0
        if self._interval_spec is not None:
            self._interval_spec = SpecDecodingStats(self._interval_spec.num_spec_tokens)

    def render(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)
