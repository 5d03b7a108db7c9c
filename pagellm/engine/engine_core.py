"""The engine core: schedule a step, run it, hand the results back. Token ids only, no text."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

from pagellm.attention.kv_quant import kv_cache_dtype_name
from pagellm.config import DEFAULT_KV_CACHE_MEMORY_BYTES, EngineConfig
from pagellm.core.block_hash import make_block_hasher
from pagellm.core.kv_cache_base import create_kv_cache_manager
from pagellm.core.kv_cache_manager import KVCacheManager  # noqa: F401  (registers "paged")
from pagellm.core.sched_output import EngineCoreOutput
from pagellm.core.scheduler import Scheduler
from pagellm.distributed.partition import max_kv_heads_per_rank
from pagellm.engine.stats import EngineStats, StepStats, StepTotals
from pagellm.executor.base import Executor, UniProcExecutor
from pagellm.request import Request, RequestStatus
from pagellm.structured_output import StructuredOutputManager
from pagellm.worker.kv_cache import (
    KVCachePrefaulter,
    activation_reserve_bytes,
    allocate_kv_caches,
    bytes_per_block,
    determine_num_blocks,
    gpu_kv_cache_budget,
)
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


class EngineCore:
    """One KV cache, its scheduler and the model runner; ``step()`` runs one batch.

    ``kv_cache_manager`` names a registered manager and ``scheduler_cls`` picks the admission
    policy; pagellm serves with the defaults, and the benchmarks swap in the traditional design.

    With ``model`` the runner lives in this process (the ``uni`` executor). Under tensor
    parallelism ``model`` is None and ``executor_factory(num_blocks, max_model_len)`` starts the
    ranks, each with its shard of the model and ``num_blocks`` blocks of its own KV heads; the KV
    cache budget is then per rank (sized by the rank holding the most KV heads).
    """

    def __init__(
        self,
        config: EngineConfig,
        model: Optional[torch.nn.Module],
        shape: ModelShape,
        max_model_len: int,
        kv_cache_manager: str = "paged",
        scheduler_cls: type[Scheduler] = Scheduler,
        executor_factory: Optional[Callable[[int, int], Executor]] = None,
        structured_output: Optional[StructuredOutputManager] = None,
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        kv_heads = max_kv_heads_per_rank(shape.num_kv_heads, config.tensor_parallel_size)
        block_bytes = bytes_per_block(shape.num_layers, config.block_size, kv_heads, shape.head_dim, config.kv_cache_dtype)
        kv_cache_memory_bytes = config.kv_cache_memory_bytes
        if (
            kv_cache_memory_bytes is None
            and config.num_kv_blocks is None
            and config.device.type == "cuda"
            and model is not None
        ):
            kv_cache_memory_bytes = self._gpu_kv_cache_budget(config, model, shape)
        self.num_blocks = determine_num_blocks(
            config.num_kv_blocks,
            kv_cache_memory_bytes,
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
        self.runner: Optional[ModelRunner] = None
        if executor_factory is None:
            kv_caches = allocate_kv_caches(
                shape.num_layers,
                self.num_blocks,
                config.block_size,
                shape.num_kv_heads,
                shape.head_dim,
                config.kv_cache_dtype,
                config.device,
            )
            self.runner = ModelRunner(
                model,
                kv_caches,
                config.block_size,
                config.max_num_seqs,
                max_model_len,
                shape.vocab_size,
                config.enforce_eager,
                structured_output,
                config.calculate_kv_scales,
            )
            self.executor: Executor = UniProcExecutor(self.runner, KVCachePrefaulter(kv_caches))
        else:
            self.executor = executor_factory(self.num_blocks, max_model_len)
        self.kv_cache_manager = create_kv_cache_manager(
            kv_cache_manager, self.num_blocks, config.block_size, max_model_len, config.enable_prefix_caching
        )
        self.scheduler = scheduler_cls(
            self.kv_cache_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
        )
        self.block_hasher = make_block_hasher(config.block_size) if config.enable_prefix_caching else None
        self._last_step: Optional[StepStats] = None
        self._step_totals = StepTotals()
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB, %d tokens, %s)",
            self.num_blocks,
            config.block_size,
            self.kv_cache_bytes / 2**20,
            self.num_blocks * config.block_size,
            kv_cache_dtype_name(config.kv_cache_dtype),
        )

    def make_request(self, request_id: str, prompt_token_ids: list[int], params, max_tokens: int, **kwargs) -> Request:
        return Request(request_id, prompt_token_ids, params, max_tokens, block_hasher=self.block_hasher, **kwargs)

    @staticmethod
    def _gpu_kv_cache_budget(config: EngineConfig, model: torch.nn.Module, shape: ModelShape) -> int:
        hf_config = getattr(model, "config", None)
        hidden = getattr(hf_config, "hidden_size", 4096)
        reserve = activation_reserve_bytes(
            config.max_num_batched_tokens,
            config.max_num_seqs,
            hidden,
            getattr(hf_config, "intermediate_size", 4 * hidden),
            shape.vocab_size,
            torch.empty((), dtype=config.dtype).element_size(),
        )
        torch.cuda.empty_cache()
        return gpu_kv_cache_budget(config.gpu_memory_utilization, reserve, lambda: torch.cuda.mem_get_info(config.device))

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
        runner_out = self.executor.execute_model(sched_out)
        t2 = time.perf_counter()
        outputs = self.scheduler.update_from_output(sched_out, runner_out)
        t3 = time.perf_counter()
        phases = self.executor.last_timings
        self._last_step = StepStats(
            num_scheduled_tokens=sched_out.total_num_scheduled_tokens,
            num_reqs=len(sched_out.num_scheduled_tokens),
            num_prefill_tokens=sum(n for n in sched_out.num_scheduled_tokens.values() if n > 1),
            duration_s=t3 - t0,
            schedule_s=t1 - t0,
            prepare_s=phases.get("prepare", 0.0),
            forward_s=phases.get("forward", 0.0),
            sample_s=phases.get("sample", 0.0),
            update_s=t3 - t2,
            comm_s=phases.get("comm", 0.0),
        )
        self._step_totals.add(self._last_step)
        return outputs

    def prefault_kv_cache(self) -> bool:
        """Faults in one more slice of the KV cache's memory (for idle time); whether any remain."""
        return self.executor.prefault_kv_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()

    def stats(self) -> EngineStats:
        """A read-only snapshot: queues, KV cache, prefix cache and step counters (all cumulative)."""
        return EngineStats(self.scheduler.stats(), dataclasses.replace(self._step_totals), self._last_step)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()
