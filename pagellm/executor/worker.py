"""One worker per rank: its shard of the model, its KV caches and the runner that steps them.

The in-process executor runs one ``Worker``; the multiprocessing and Ray executors run one in
each tensor-parallel rank. All of them are built the same way from the resolved configuration:
load the model (and a draft model), then, once the engine core has fixed the block count,
allocate the KV caches and build the LoRA manager, the drafter, CUDA graphs and the
``ModelRunner``. Every rank allocates the same number of blocks (the block ids the driver's KV
cache manager hands out are valid on all of them), each holding only its own KV heads, grouped
by attention kind as the driver's manager groups them.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from pagellm.attention.selector import get_attn_backend
from pagellm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagellm.distributed.parallel_state import get_tp_group, init_tensor_parallel
from pagellm.distributed.partition import split_evenly
from pagellm.executor.kv_tier import RankTierReport, distinct_kv_tensors, make_offloader, state_tensors_of
from pagellm.lora.model_manager import LoRAModelManager
from pagellm.lora.request import LoRARequest
from pagellm.models.loader import load_model_for_engine
from pagellm.plan.kv_cache_plan import KVCachePlan
from pagellm.plan.resolved_config import ResolvedConfig
from pagellm.spec_decode.draft_model import DraftModelProposer, load_draft_model
from pagellm.spec_decode.ngram_proposer import NgramProposer
from pagellm.structured_output import StructuredOutputManager
from pagellm.structured_output.reasoning import reasoning_bounds
from pagellm.worker.kv_cache import (
    KVCachePrefaulter,
    allocate_grouped_kv_caches,
    allocate_kv_caches,
    allocate_state_caches,
    gpu_kv_cache_budget,
)
from pagellm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class RankSpec:
    """Where a tensor-parallel rank runs, picklable: its process group and its cores."""

    rank: int
    world_size: int
    init_method: str
    num_threads: int
    cpus: Optional[list[int]] = None


def rank_cpus(rank: int, world_size: int) -> tuple[int, Optional[list[int]]]:
    """(threads, cores to pin to) for a rank: its share of this process's cores; no pinning when
    there are fewer cores than ranks."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cores) < world_size:
        return 1, None
    per = len(cores) // world_size
    mine = cores[rank * per : (rank + 1) * per]
    return len(mine), mine


def join_rank(resolved: ResolvedConfig, rank: RankSpec) -> None:
    """Pins a rank process to its cores and threads and joins its process group."""
    if rank.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, rank.cpus)
    torch.set_num_threads(resolved.args.num_threads or rank.num_threads)
    torch.manual_seed(resolved.args.seed)
    if resolved.device.type == "cuda":
        torch.cuda.set_device(rank.rank)
    init_tensor_parallel(rank.rank, rank.world_size, rank.init_method)


def serve_rpc(worker: Worker, method: str, args: tuple) -> tuple[str, Any]:
    """A remote rank's answer to one collective call: ("ok", result), or ("value_error", message)
    for input the engine refuses (a bad adapter) without stopping the rank."""
    try:
        return "ok", getattr(worker, method)(*args)
    except ValueError as e:
        return "value_error", str(e)


def rpc_results(replies: list[tuple[str, Any]]) -> list[Any]:
    """The ranks' results, or the first rank's ValueError raised in the driver."""
    for status, value in replies:
        if status == "value_error":
            raise ValueError(value)
    return [value for _, value in replies]


class Worker:
    """``model`` (tests) skips loading; ``eos_token_ids`` let rank 0 build its own grammar masks
    when no ``StructuredOutputManager`` is handed to ``initialize_kv_cache``."""

    def __init__(
        self,
        resolved: ResolvedConfig,
        rank: int = 0,
        model: Optional[torch.nn.Module] = None,
        eos_token_ids: Optional[set[int]] = None,
    ) -> None:
        self.resolved = resolved
        self.rank = rank
        self.eos_token_ids = set(eos_token_ids or ())
        config = resolved.args
        self.device = torch.device("cuda", rank) if resolved.device.type == "cuda" and config.tensor_parallel_size > 1 else resolved.device
        self.attn_backend = get_attn_backend(resolved.attention_backend, self.device)
        if model is None:
            model, _ = load_model_for_engine(
                resolved.model.path,
                resolved.model.hf_config,
                self.attn_backend,
                dtype=resolved.precision.dtype,
                device=self.device,
                precision=resolved.precision.linear,
                kv_cache_dtype=resolved.precision.kv_cache_dtype,
                tensor_parallel_size=config.tensor_parallel_size,
                packed_weight_cache=config.packed_weight_cache,
            )
        self.model = model
        self.draft_model: Optional[torch.nn.Module] = None
        if resolved.draft is not None:
            self.draft_model = load_draft_model(
                resolved.draft.path,
                resolved.draft.hf_config,
                self.attn_backend,
                dtype=resolved.precision.dtype,
                device=self.device,
                precision=resolved.draft_linear,
                packed_weight_cache=config.packed_weight_cache,
            )
        self.runner: Optional[ModelRunner] = None
        self.prefaulter: Optional[KVCachePrefaulter] = None

    # ---- memory ------------------------------------------------------------------------

    def available_kv_cache_bytes(self) -> int:
        """An accelerator's KV cache budget, vLLM's way: its allowed share less what the loaded
        weights and a step's activations take."""
        torch.cuda.empty_cache()
        return gpu_kv_cache_budget(
            self.resolved.args.gpu_memory_utilization,
            self.resolved.memory.activation_bytes,
            lambda: torch.cuda.mem_get_info(self.device),
        )

    def initialize_kv_cache(self, kv_cache: KVCachePlan, structured_output: Optional[StructuredOutputManager] = None) -> None:
        """Allocates this rank's KV caches for ``kv_cache`` and builds the runner around them."""
        self.release_kv_cache()
        resolved, config = self.resolved, self.resolved.args
        cache_dtype = resolved.precision.kv_cache_dtype
        head_dim = resolved.model.shape.head_dim
        shape, tp_size = resolved.model.shape, config.tensor_parallel_size
        # Layers of different shapes (Gemma 4): each layer's own KV heads on this rank (narrow ones pad into the widest).
        layer_kv_heads = [(split_evenly(h, tp_size)[self.rank][1], d) for h, d in shape.layer_kv_heads] if shape.layer_kv_heads else None
        kv_caches = allocate_grouped_kv_caches(
            kv_cache.layout, kv_cache.num_blocks, kv_cache.block_size, self._num_kv_heads(), head_dim, cache_dtype, self.device,
            layer_kv_heads,
        )
        precision = resolved.precision
        state_caches = allocate_state_caches(
            len(shape.state_layer_ids),
            kv_cache.num_state_slots,
            [(t.per_rank(tp_size), t.dtype(precision.conv_state_dtype, precision.ssm_state_dtype)) for t in shape.state_tensors],
            self.device,
        )
        for layer, state in zip(shape.state_layer_ids, state_caches):
            kv_caches[layer] = state
        drafter = NgramProposer.from_config(config.speculative_config)
        draft_caches: list[torch.Tensor] = []
        if self.draft_model is not None:
            draft = resolved.draft.shape
            draft_caches = allocate_kv_caches(
                draft.num_layers, kv_cache.num_blocks, kv_cache.block_size, draft.num_kv_heads, draft.head_dim, cache_dtype, self.device
            )
            drafter = DraftModelProposer(self.draft_model, draft_caches, kv_cache.block_size)
        lora_manager = None
        if config.enable_lora:
            lora_manager = LoRAModelManager(
                self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras, resolved.precision.lora_dtype, self.device
            )
            logger.info("LoRA: %d slots of rank <= %d (%.1f MiB)", config.max_loras, config.max_lora_rank, lora_manager.nbytes / 2**20)
        offloader = make_offloader(
            resolved, kv_cache, self.rank, distinct_kv_tensors(kv_caches, draft_caches), state_tensors_of(kv_caches, kv_cache)
        )
        if structured_output is None and self.rank == 0 and config.tensor_parallel_size > 1 and not config.is_pooling:
            structured_output = self._structured_output()  # the driver's stays in its process
        self.runner = ModelRunner(
            self.model,
            kv_caches,
            kv_cache.block_size,
            config.max_num_seqs,
            kv_cache.max_model_len,
            resolved.model.shape.vocab_size,
            self._enforce_eager(),
            structured_output if self.rank == 0 else None,  # only rank 0 samples, so only it masks logits
            config.calculate_kv_scales,
            kv_cache_layout=kv_cache.layout,
            drafter=drafter,
            pooler_config=config.pooler_config,
            lora_manager=lora_manager,
            offloader=offloader,
        )
        self.prefaulter = KVCachePrefaulter([c for c in kv_caches if isinstance(c, torch.Tensor)] + draft_caches)
        if config.tensor_parallel_size > 1:
            self._log_rank()

    def drain_kv_tier(self, timeout_s: float = 120.0) -> None:
        """Waits for the offloading tier's queued writes (a flush before shutdown)."""
        if self.runner is not None and self.runner.offloader is not None:
            self.runner.offloader.drain(timeout_s)

    def kv_tier_keys(self) -> list[bytes]:
        """The keys this rank's offloading tier holds (what it found at start), for the scheduler."""
        offloader = self.runner.offloader if self.runner is not None else None
        return offloader.store.keys() if offloader is not None else []

    def release_kv_cache(self) -> None:
        """Drops the runner and its caches (before a benchmark builds another design's)."""
        if self.runner is not None and self.runner.offloader is not None:
            self.runner.offloader.close()
        self.runner = None
        self.prefaulter = None

    def prefault_kv_cache(self) -> bool:
        return self.prefaulter.prefault_next() if self.prefaulter is not None else False

    # ---- steps and adapters ------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> Optional[ModelRunnerOutput]:
        """One step; every rank computes it, rank 0's output is the engine's."""
        return self.runner.execute_model(scheduler_output)

    @property
    def last_timings(self) -> dict[str, float]:
        return self.runner.last_timings if self.runner is not None else {}

    def execute_and_time(self, scheduler_output: SchedulerOutput) -> Any:
        """A rank's step: rank 0 returns (output, timings with the collectives' share); the others
        their offloading tier's report (``RankTierReport``, which the executor joins into rank 0's
        output), or None without a tier."""
        tp = get_tp_group()
        tp.comm_s = 0.0
        t0 = time.perf_counter()
        out = self.execute_model(scheduler_output)
        if self.rank != 0:
            if self.runner.offloader is None:
                return None
            return RankTierReport(out.kv_loads_done, out.kv_tier_removed, out.kv_tier_stats)
        return out, dict(self.last_timings, comm=tp.comm_s, worker=time.perf_counter() - t0)

    def add_lora(self, lora: LoRARequest) -> None:
        """Loads and checks an adapter on this rank (its shard of each layer); ValueError if it cannot be served."""
        if self.runner is None or self.runner.lora_manager is None:
            raise ValueError("LoRA adapters need an engine started with enable_lora=True (--enable-lora)")
        self.runner.lora_manager.add_lora(lora)

    def remove_lora(self, lora_int_id: int) -> bool:
        manager = self.runner.lora_manager if self.runner is not None else None
        return manager.remove_lora(lora_int_id) if manager is not None else False

    # ---- helpers -----------------------------------------------------------------------

    def _num_kv_heads(self) -> int:
        shard = getattr(self.model, "shard", None)
        return shard.num_kv_heads if shard is not None else self.resolved.model.shape.num_kv_heads

    def _enforce_eager(self) -> bool:
        """Decode steps replay CUDA graphs unless asked not to, or where a replay would be wrong."""
        config = self.resolved.args
        if config.enforce_eager or self.device.type != "cuda":
            return True
        if config.enable_lora:
            logger.info("CUDA graphs are off: a replay would run without the step's LoRA adapters")
            return True
        if config.tensor_parallel_size > 1:
            logger.info("CUDA graphs are off under tensor parallelism: collectives are not captured")
            return True
        return False

    def _structured_output(self) -> StructuredOutputManager:
        from pagellm.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(self.resolved.args.tokenizer or self.resolved.model.path)
        args = self.resolved.args
        bounds = reasoning_bounds(tokenizer, args.reasoning_parser, args.reasoning_config)
        return StructuredOutputManager(tokenizer, self.resolved.model.shape.vocab_size, self.eos_token_ids, bounds)

    def _log_rank(self) -> None:
        shard = self.model.shard
        logger.info(
            "rank %d/%d ready: q heads %d-%d, kv heads %d-%d, %d threads",
            self.rank,
            self.resolved.tensor_parallel_size,
            shard.q_head_start,
            shard.q_head_start + shard.num_q_heads - 1,
            shard.kv_head_start,
            shard.kv_head_start + shard.num_kv_heads - 1,
            torch.get_num_threads(),
        )
