"""The engine core: schedule a step, run it, hand the results back. Token ids only, no text."""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Iterable, Optional

import torch

from pagellm.config import DEFAULT_KV_CACHE_MEMORY_BYTES, EngineConfig
from pagellm.core.block_hash import make_block_hasher
from pagellm.core.kv_cache_manager import KVCacheManager
from pagellm.core.sched_output import EngineCoreOutput
from pagellm.core.scheduler import Scheduler, SchedulerStats
from pagellm.request import Request, RequestStatus
from pagellm.worker.kv_cache import KVCachePrefaulter, allocate_kv_caches, bytes_per_block, determine_num_blocks
from pagellm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class ModelShape:
    """What the engine needs to know about a model to size its cache and batch."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_hf_config(cls, hf_config) -> "ModelShape":
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        return cls(
            num_layers=hf_config.num_hidden_layers,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=hf_config.vocab_size,
        )


@dataclass
class StepStats:
    num_scheduled_tokens: int
    num_reqs: int
    num_prefill_tokens: int
    duration_s: float
    # Where the step's time went (seconds): scheduling, the runner's phases, bookkeeping after.
    schedule_s: float = 0.0
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    update_s: float = 0.0


class EngineCore:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, shape: ModelShape, max_model_len: int) -> None:
        self.config = config
        self.block_size = config.block_size
        block_bytes = bytes_per_block(
            shape.num_layers, config.block_size, shape.num_kv_heads, shape.head_dim, config.kv_cache_dtype
        )
        self.num_blocks = determine_num_blocks(
            config.num_kv_blocks,
            config.kv_cache_memory_bytes,
            DEFAULT_KV_CACHE_MEMORY_BYTES,
            block_bytes,
            config.block_size,
            max_model_len,
        )
        self.kv_cache_bytes = self.num_blocks * block_bytes
        # A request longer than the whole cache could never be scheduled and would wait forever.
        capacity = self.num_blocks * config.block_size
        if max_model_len > capacity:
            if config.max_model_len is not None:
                raise ValueError(
                    f"max_model_len={max_model_len} does not fit in the KV cache, which holds {capacity} tokens "
                    f"({self.num_blocks} blocks of {config.block_size}); raise the KV cache budget or lower max_model_len"
                )
            logger.warning("the KV cache holds %d tokens: max_model_len lowered from %d to %d", capacity, max_model_len, capacity)
            max_model_len = capacity
        self.max_model_len = max_model_len
        kv_caches = allocate_kv_caches(
            shape.num_layers,
            self.num_blocks,
            config.block_size,
            shape.num_kv_heads,
            shape.head_dim,
            config.kv_cache_dtype,
            config.device,
        )
        self.kv_cache_prefaulter = KVCachePrefaulter(kv_caches)
        self.kv_cache_manager = self._make_kv_cache_manager()
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            static_batching=config.kv_layout == "contiguous",
        )
        self.runner = ModelRunner(
            model, kv_caches, config.block_size, config.max_num_seqs, max_model_len, shape.vocab_size
        )
        self.block_hasher = make_block_hasher(config.block_size) if config.enable_prefix_caching else None
        self.last_step: Optional[StepStats] = None
        # Running totals for benchmarks: steps that carried prompt tokens vs decode-only steps.
        self.totals = {"prefill_steps_s": 0.0, "prefill_tokens": 0, "decode_steps_s": 0.0, "decode_tokens": 0}
        # PAGELLM_STEP_TRACE=path appends one JSON line per step (its StepStats plus the time since
        # the previous step ended), to see where a real run's time goes without a profiler.
        trace_path = os.environ.get("PAGELLM_STEP_TRACE")
        self._trace = open(trace_path, "a", buffering=1) if trace_path else None
        self._last_step_end: Optional[float] = None
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB, %d tokens, %s)",
            self.num_blocks,
            config.block_size,
            self.kv_cache_bytes / 2**20,
            self.num_blocks * config.block_size,
            str(config.kv_cache_dtype).removeprefix("torch."),
        )

    def _make_kv_cache_manager(self) -> KVCacheManager:
        if self.config.kv_layout == "contiguous":
            from pagellm.core.contiguous_kv_cache_manager import ContiguousKVCacheManager

            return ContiguousKVCacheManager(self.num_blocks, self.block_size, self.max_model_len)
        return KVCacheManager(self.num_blocks, self.block_size, self.max_model_len, self.config.enable_prefix_caching)

    def make_request(self, request_id: str, prompt_token_ids: list[int], params, max_tokens: int, **kwargs) -> Request:
        return Request(request_id, prompt_token_ids, params, max_tokens, block_hasher=self.block_hasher, **kwargs)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        t0 = time.perf_counter()
        sched_out = self.scheduler.schedule()
        t1 = time.perf_counter()
        runner_out = self.runner.execute_model(sched_out)
        t2 = time.perf_counter()
        outputs = self.scheduler.update_from_output(sched_out, runner_out)
        t3 = time.perf_counter()
        num_prefill = sum(n for n in sched_out.num_scheduled_tokens.values() if n > 1)
        phases = self.runner.last_timings
        self.last_step = StepStats(
            sched_out.total_num_scheduled_tokens,
            len(sched_out.num_scheduled_tokens),
            num_prefill,
            t3 - t0,
            schedule_s=t1 - t0,
            prepare_s=phases.get("prepare", 0.0),
            forward_s=phases.get("forward", 0.0),
            sample_s=phases.get("sample", 0.0),
            update_s=t3 - t2,
        )
        kind = "prefill" if num_prefill else "decode"
        self.totals[f"{kind}_steps_s"] += t3 - t0
        self.totals[f"{kind}_tokens"] += num_prefill if num_prefill else sched_out.total_num_scheduled_tokens
        if self._trace is not None:
            gap = t0 - self._last_step_end if self._last_step_end is not None else 0.0
            self._trace.write(json.dumps({"t": t0, "gap_s": gap, **asdict(self.last_step)}) + "\n")
        self._last_step_end = t3
        return outputs

    def prefault_kv_cache(self) -> bool:
        """Faults in one more slice of the KV cache's memory (for idle time); whether any remain."""
        return self.kv_cache_prefaulter.prefault_next()

    def make_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()
