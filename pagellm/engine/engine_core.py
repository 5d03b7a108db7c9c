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
from pagellm.core.kv_cache_base import create_kv_cache_manager, kv_cache_manager_class
from pagellm.core.kv_cache_groups import KVCacheLayout, group_layers, single_group_layout
from pagellm.core.kv_cache_manager import KVCacheManager  # noqa: F401  (registers "paged")
from pagellm.core.sched_output import EngineCoreOutput
from pagellm.core.scheduler import Scheduler
from pagellm.distributed.partition import max_kv_heads_per_rank
from pagellm.engine.stats import EngineStats, StepStats, StepTotals
from pagellm.executor.base import Executor, UniProcExecutor
from pagellm.lora.model_manager import LoRAModelManager
from pagellm.lora.request import LoRARequest
from pagellm.models.shape import ModelShape
from pagellm.request import Request, RequestStatus
from pagellm.spec_decode.draft_model import DraftModelProposer
from pagellm.spec_decode.ngram_proposer import NgramProposer
from pagellm.structured_output import StructuredOutputManager
from pagellm.worker.kv_cache import (
    KVCachePrefaulter,
    activation_reserve_bytes,
    allocate_grouped_kv_caches,
    allocate_kv_caches,
    bytes_per_block,
    determine_num_blocks,
    gpu_kv_cache_budget,
)
from pagellm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestKVUsage:
    """The KV cache one request holds now, all KV cache groups together."""

    num_blocks: int  # pool blocks (a prefix block shared with others counts for each holder)
    num_bytes: int


def kv_cache_layout_for(shape: ModelShape, kv_cache_manager: str) -> KVCacheLayout:
    """The model's KV cache groups; a manager that keeps whole contexts gets one full-attention group."""
    if kv_cache_manager_class(kv_cache_manager).supports_sliding_window:
        return group_layers(shape.layer_sliding_windows)
    return single_group_layout(shape.num_layers)


class EngineCore:
    """One KV cache, its scheduler and the model runner; ``step()`` runs one batch.

    ``kv_cache_manager`` names a registered manager and ``scheduler_cls`` picks the admission
    policy; pagellm serves with the defaults, and the benchmarks swap in the traditional design.

    With ``model`` the runner lives in this process (the ``uni`` executor). Under tensor
    parallelism ``model`` is None and ``executor_factory(num_blocks, max_model_len)`` starts the
    ranks, each with its shard of the model and ``num_blocks`` blocks of its own KV heads; the KV
    cache budget is then per rank (sized by the rank holding the most KV heads).

    Layers are grouped by attention kind (``kv_cache_layout``): a block holds ``group_size``
    layers' keys and values, so a hybrid model's budget buys more blocks, and its sliding groups
    free the blocks their windows have left.
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
        draft: Optional[tuple[torch.nn.Module, ModelShape]] = None,
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        layout = kv_cache_layout_for(shape, kv_cache_manager)
        if executor_factory is not None and layout != group_layers(shape.layer_sliding_windows):
            raise ValueError(f"tensor-parallel ranks lay the KV cache out by attention kind; the {kv_cache_manager!r} manager cannot")
        self.kv_cache_layout = layout
        kv_heads = max_kv_heads_per_rank(shape.num_kv_heads, config.tensor_parallel_size)
        block_bytes = bytes_per_block(layout.group_size, config.block_size, kv_heads, shape.head_dim, config.kv_cache_dtype)
        if draft is not None:
            if not layout.plain:
                raise ValueError("a speculative draft model needs a target whose layers all attend in full; use 'ngram'")
            # The draft's cache has the same blocks, so a block of the budget holds both models' KV.
            draft_shape = draft[1]
            block_bytes += bytes_per_block(
                draft_shape.num_layers, config.block_size, draft_shape.num_kv_heads, draft_shape.head_dim, config.kv_cache_dtype
            )
        self.kv_block_bytes = block_bytes
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
        # Tokens of full context the cache holds (vLLM's count: the usable blocks shared evenly by the groups).
        self.kv_cache_tokens = (self.num_blocks - layout.num_reserved_blocks) // layout.num_groups * config.block_size
        # A request longer than the whole cache could never be scheduled and would wait forever.
        chunk = config.max_num_batched_tokens
        needed = layout.max_blocks_per_request(max_model_len, config.block_size, chunk) + layout.num_reserved_blocks
        if needed > self.num_blocks:
            capacity = layout.max_tokens_that_fit(self.num_blocks, config.block_size, chunk, max_model_len)
            groups = "" if layout.plain else f", {layout.describe()}"
            if config.max_model_len is not None:
                raise ValueError(
                    f"max_model_len={max_model_len} does not fit in the KV cache, which holds {capacity} tokens "
                    f"({self.num_blocks} blocks of {config.block_size}{groups}); raise the KV cache budget or lower max_model_len"
                )
            logger.warning("the KV cache holds %d tokens: max_model_len lowered from %d to %d", capacity, max_model_len, capacity)
            max_model_len = capacity
        self.max_model_len = max_model_len
        self.runner: Optional[ModelRunner] = None
        if executor_factory is None:
            kv_caches = allocate_grouped_kv_caches(
                layout,
                self.num_blocks,
                config.block_size,
                shape.num_kv_heads,
                shape.head_dim,
                config.kv_cache_dtype,
                config.device,
            )
            drafter = NgramProposer.from_config(config.speculative_config)
            draft_caches: list[torch.Tensor] = []
            if draft is not None:
                draft_shape = draft[1]
                draft_caches = allocate_kv_caches(
                    draft_shape.num_layers,
                    self.num_blocks,
                    config.block_size,
                    draft_shape.num_kv_heads,
                    draft_shape.head_dim,
                    config.kv_cache_dtype,
                    config.device,
                )
                drafter = DraftModelProposer(draft[0], draft_caches, config.block_size)
            lora_manager = None
            if config.enable_lora:
                lora_manager = LoRAModelManager(
                    model, config.max_loras, config.max_lora_rank, config.max_cpu_loras, config.lora_dtype, config.device
                )
                logger.info("LoRA: %d slots of rank <= %d (%.1f MiB)", config.max_loras, config.max_lora_rank, lora_manager.nbytes / 2**20)
            self.runner = ModelRunner(
                model,
                kv_caches,
                config.block_size,
                config.max_num_seqs,
                max_model_len,
                shape.vocab_size,
                config.enforce_eager or config.enable_lora,  # graphs would replay without the step's adapters
                structured_output,
                config.calculate_kv_scales,
                kv_cache_layout=layout,
                drafter=drafter,
                pooler_config=config.pooler_config,
                lora_manager=lora_manager,
            )
            self.executor: Executor = UniProcExecutor(self.runner, KVCachePrefaulter(kv_caches + draft_caches))
        else:
            self.executor = executor_factory(self.num_blocks, max_model_len)
        self.kv_cache_manager = create_kv_cache_manager(
            kv_cache_manager,
            self.num_blocks,
            config.block_size,
            max_model_len,
            config.enable_prefix_caching,
            kv_cache_layout=None if layout.plain else layout,
        )
        self.scheduler = scheduler_cls(
            self.kv_cache_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            speculative_config=config.speculative_config,
            max_loras=config.max_loras if config.enable_lora else 0,
        )
        self.block_hasher = make_block_hasher(config.block_size) if config.enable_prefix_caching else None
        self._last_step: Optional[StepStats] = None
        self._step_totals = StepTotals()
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB, %d tokens, %s, %s)",
            self.num_blocks,
            config.block_size,
            self.kv_cache_bytes / 2**20,
            self.kv_cache_tokens,
            kv_cache_dtype_name(config.kv_cache_dtype),
            layout.describe(),
        )

    def make_request(self, request_id: str, prompt_token_ids: list[int], params, max_tokens: int, **kwargs) -> Request:
        """``pooling_params`` in ``kwargs`` makes a pooling request (with ``max_tokens`` 0)."""
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

    @property
    def lora_manager(self) -> Optional[LoRAModelManager]:
        return self.runner.lora_manager if self.runner is not None else None

    def add_lora(self, lora: LoRARequest) -> None:
        """Loads and checks an adapter before any request uses it; ValueError if it cannot be served."""
        if self.lora_manager is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora=True (--enable-lora)")
        self.lora_manager.add_lora(lora)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.lora_manager.remove_lora(lora_int_id) if self.lora_manager is not None else False

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
        # The step's own width and cost, and apart from it what proposing the next drafts cost.
        propose_s = phases.get("propose", 0.0)
        self.scheduler.observe_step_cost(sched_out.total_num_scheduled_tokens, t3 - t0 - propose_s)
        if "propose_pass" in phases:
            self.scheduler.observe_proposal_cost(len(sched_out.num_draft_tokens_to_propose), phases["propose_pass"])
        self._last_step = StepStats(
            num_scheduled_tokens=sched_out.total_num_scheduled_tokens,
            num_reqs=len(sched_out.num_scheduled_tokens),
            num_prefill_tokens=sum(
                n for r, n in sched_out.num_scheduled_tokens.items() if n > 1 and r not in sched_out.scheduled_spec_decode_tokens
            ),
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

    def request_kv_usage(self, request_id: str) -> RequestKVUsage:
        """What one request holds in the KV cache now (nothing once it finished or was preempted)."""
        num_blocks = self.kv_cache_manager.num_held_blocks(request_id)
        return RequestKVUsage(num_blocks, num_blocks * self.kv_block_bytes)
