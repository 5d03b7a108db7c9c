"""The engine core: schedule a step, run it, hand the results back. Token ids only, no text."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Iterable, Optional

from pagellm.attention.kv_quant import kv_cache_dtype_name
from pagellm.core.block_hash import make_block_hasher
from pagellm.core.kv_cache_base import create_kv_cache_manager
from pagellm.core.kv_cache_groups import KVCacheLayout
from pagellm.core.kv_cache_manager import KVCacheManager  # noqa: F401  (registers "paged")
from pagellm.core.sched_output import EngineCoreOutput, SchedulerOutput
from pagellm.core.scheduler import Scheduler
from pagellm.engine.stats import EngineStats, StepStats, StepTotals
from pagellm.executor.base import Executor
from pagellm.lora.request import LoRARequest
from pagellm.plan.kv_cache_plan import KVCachePlan, kv_cache_layout_for, plan_kv_cache
from pagellm.plan.resolved_config import ResolvedConfig
from pagellm.request import Request, RequestStatus
from pagellm.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestKVUsage:
    """The KV cache one request holds now, all KV cache groups together."""

    num_blocks: int  # pool blocks (a prefix block shared with others counts for each holder)
    num_bytes: int  # the blocks' bytes, and a hybrid model's live state slot
    num_state_bytes: int = 0  # of num_bytes, the recurrent state


class EngineCore:
    """The KV cache manager, its scheduler and an executor; ``step()`` runs one batch.

    ``kv_cache_manager`` names a registered manager and ``scheduler_cls`` picks the admission
    policy; pagellm serves with the defaults, and the benchmarks swap in the traditional design.
    The executor's workers (one, or one per tensor-parallel rank) have their models loaded; the
    core fixes the block count, has every worker allocate it, and schedules over it. Under tensor
    parallelism the budget is per rank, sized by the rank holding the most KV heads.

    Layers are grouped by attention kind (the plan's ``layout``): a block holds ``group_size``
    layers' keys and values, so a hybrid model's budget buys more blocks, and its sliding groups
    free the blocks their windows have left.
    """

    def __init__(
        self,
        resolved: ResolvedConfig,
        executor: Executor,
        kv_cache_manager: str = "paged",
        scheduler_cls: type[Scheduler] = Scheduler,
        structured_output: Optional[StructuredOutputManager] = None,
    ) -> None:
        config = resolved.args
        self.config = config
        self.resolved = resolved
        self.block_size = config.block_size
        self.executor = executor
        kv = self._plan_kv_cache(resolved, executor, kv_cache_manager)
        self.kv_cache_plan = kv
        executor.initialize_kv_cache(kv, structured_output)
        self.kv_cache_manager = create_kv_cache_manager(
            kv_cache_manager,
            kv.num_blocks,
            config.block_size,
            kv.max_model_len,
            config.enable_prefix_caching,
            kv_cache_layout=None if kv.layout.plain else kv.layout,
            num_state_slots=kv.num_state_slots,
            state_checkpoint_interval=config.state_checkpoint_interval,
            num_state_draft_slots=kv.num_state_draft_slots,
        )
        if config.kv_offloading_backend is not None:
            self.kv_cache_manager.enable_tier(executor.kv_tier_keys())
        self.scheduler = scheduler_cls(
            self.kv_cache_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=kv.max_model_len,
            speculative_config=config.speculative_config,
            max_loras=config.max_loras if config.enable_lora else 0,
        )
        self.block_hasher = make_block_hasher(config.block_size) if config.enable_prefix_caching else None
        self._last_step: Optional[StepStats] = None
        self._step_totals = StepTotals()
        self._loras: dict[int, LoRARequest] = {}  # adapters every rank has taken
        logger.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB, %d tokens, %s, %s)",
            kv.num_blocks,
            config.block_size,
            kv.num_bytes / 2**20,
            kv.num_tokens,
            kv_cache_dtype_name(resolved.precision.kv_cache_dtype),
            kv.layout.describe(),
        )

    @staticmethod
    def _plan_kv_cache(resolved: ResolvedConfig, executor: Executor, kv_cache_manager: str) -> KVCachePlan:
        """The resolved plan, unless the manager lays the cache out differently or an
        accelerator's budget is what its loaded weights left free."""
        layout = kv_cache_layout_for(resolved.model.shape, kv_cache_manager)
        if resolved.tensor_parallel_size > 1 and layout != resolved.kv_cache.layout:
            raise ValueError(f"tensor-parallel ranks lay the KV cache out by attention kind; the {kv_cache_manager!r} manager cannot")
        if layout == resolved.kv_cache.layout and not resolved.kv_cache_from_free_memory:
            return resolved.kv_cache
        budget = executor.available_kv_cache_bytes() if resolved.kv_cache_from_free_memory else None
        draft = resolved.draft.shape if resolved.draft is not None else None
        config = resolved.args
        max_model_len = config.max_model_len or resolved.model_max_len
        precision = resolved.precision
        return plan_kv_cache(
            config, resolved.model.shape, precision.kv_cache_dtype, max_model_len, layout, draft, budget,
            precision.conv_state_dtype, precision.ssm_state_dtype,
        )

    # The plan's figures, as the benchmarks and the server read them.
    @property
    def kv_cache_layout(self) -> KVCacheLayout:
        return self.kv_cache_plan.layout

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_plan.num_blocks

    @property
    def kv_block_bytes(self) -> int:
        return self.kv_cache_plan.block_bytes

    @property
    def kv_cache_bytes(self) -> int:
        return self.kv_cache_plan.num_bytes

    @property
    def kv_cache_tokens(self) -> int:
        return self.kv_cache_plan.num_tokens

    @property
    def max_model_len(self) -> int:
        return self.kv_cache_plan.max_model_len

    @property
    def runner(self):
        """The in-process worker's runner, for introspection (None when the ranks run elsewhere)."""
        worker = getattr(self.executor, "worker", None)
        return worker.runner if worker is not None else None

    def make_request(self, request_id: str, prompt_token_ids: list[int], params, max_tokens: int, **kwargs) -> Request:
        """``pooling_params`` in ``kwargs`` makes a pooling request (with ``max_tokens`` 0)."""
        return Request(request_id, prompt_token_ids, params, max_tokens, block_hasher=self.block_hasher, **kwargs)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def add_lora(self, lora: LoRARequest) -> None:
        """Loads and checks an adapter on every rank before any request uses it; ValueError if it
        cannot be served. An adapter the ranks took already costs no call (their managers reload
        one they evicted when a request needs it)."""
        if not self.config.enable_lora:
            raise ValueError("LoRA adapters need an engine started with enable_lora=True (--enable-lora)")
        known = self._loras.get(lora.lora_int_id)
        if known is not None and known.lora_path == lora.lora_path:
            return
        self.executor.add_lora(lora)
        self._loras[lora.lora_int_id] = lora

    def remove_lora(self, lora_int_id: int) -> bool:
        self._loras.pop(lora_int_id, None)
        return self.executor.remove_lora(lora_int_id) if self.config.enable_lora else False

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
        self.flush_kv_tier()
        self.executor.shutdown()

    def flush_kv_tier(self) -> int:
        """Saves every cached block the offloading tier lacks and waits for the writes (a disk tier
        then holds, for the next start, what this run computed); returns the pages saved."""
        saves = self.kv_cache_manager.tier_flush_orders()
        # A few pages at a time, each batch written before the next: the staging buffer is bounded
        # and would drop what does not fit.
        chunk = 16
        try:
            for i in range(0, len(saves), chunk):
                out = SchedulerOutput(
                    new_reqs=[], cached_reqs=[], num_scheduled_tokens={}, total_num_scheduled_tokens=0,
                    finished_req_ids=set(), preempted_req_ids=set(), kv_saves=saves[i : i + chunk],
                )
                self.executor.execute_model(out)
                self.executor.collective_rpc("drain_kv_tier")
        except Exception:  # shutting down: what did not reach the tier is recomputed next time
            logger.exception("could not flush the KV offloading tier")
        return len(saves)

    def stats(self) -> EngineStats:
        """A read-only snapshot: queues, KV cache, prefix cache and step counters (all cumulative)."""
        return EngineStats(self.scheduler.stats(), dataclasses.replace(self._step_totals), self._last_step)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def request_kv_usage(self, request_id: str) -> RequestKVUsage:
        """What one request holds in the KV cache now (nothing once it finished or was preempted)."""
        num_blocks = self.kv_cache_manager.num_held_blocks(request_id)
        state = getattr(self.kv_cache_manager, "state_cache", None)
        state_bytes = self.kv_cache_plan.state_slot_bytes if state is not None and state.has_live_slot(request_id) else 0
        return RequestKVUsage(num_blocks, num_blocks * self.kv_block_bytes + state_bytes, state_bytes)
