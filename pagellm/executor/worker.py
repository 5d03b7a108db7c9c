"""One tensor-parallel rank: its shard of the model and of the KV cache, and its step loop body.

Shared by the multiprocessing and the Ray executors. Every rank allocates the same number of KV
blocks (the block ids the driver's KV cache manager hands out are valid on all of them), each
holding only its own KV heads, and groups the layers by attention kind as the driver's paged
manager does (pagellm.core.kv_cache_groups), so each group's block ids mean the same pages.
"""
from __future__ import annotations

import logging
import os
import pickle
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

from pagellm.config import EngineConfig, model_dtype
from pagellm.distributed.parallel_state import get_tp_group, init_tensor_parallel

logger = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    """What a rank needs to build itself, picklable."""

    config: EngineConfig
    model_path: str
    num_blocks: int
    max_model_len: int
    eos_token_ids: set[int]
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


class TPWorker:
    """A rank's model runner, built after the rank joined its process group."""

    def __init__(self, rank: int, spec: WorkerSpec) -> None:
        from pagellm.attention.selector import get_attn_backend
        from pagellm.core.kv_cache_groups import group_layers
        from pagellm.models.loader import load_hf_config, load_model_for_engine
        from pagellm.models.shape import ModelShape
        from pagellm.spec_decode.ngram_proposer import NgramProposer
        from pagellm.worker.kv_cache import allocate_grouped_kv_caches
        from pagellm.worker.model_runner import ModelRunner

        self.rank = rank
        if spec.cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, spec.cpus)
        torch.set_num_threads(spec.config.num_threads or spec.num_threads)
        config = spec.config
        torch.manual_seed(config.seed)
        if config.device.type == "cuda":
            torch.cuda.set_device(rank)
            config.device = torch.device("cuda", rank)
        init_tensor_parallel(rank, spec.world_size, spec.init_method)
        hf_config = load_hf_config(spec.model_path)
        config.apply_model_dtype(model_dtype(hf_config))
        attn_backend = get_attn_backend(config.attention_backend, config.device)
        # The driver resolved the precision into the config; a rank never re-decides it, but
        # measures its own tuning (its shard, its threads).
        model, _ = load_model_for_engine(config, spec.model_path, hf_config, attn_backend)
        shard = model.shard
        head_dim = model.model.layers[0].self_attn.head_dim
        layout = group_layers(ModelShape.from_hf_config(hf_config).layer_sliding_windows)
        kv_caches = allocate_grouped_kv_caches(
            layout,
            spec.num_blocks,
            config.block_size,
            shard.num_kv_heads,
            head_dim,
            config.kv_cache_dtype,
            config.device,
        )
        structured_output = None
        if rank == 0:  # only rank 0 samples, so only it masks logits by grammar
            from pagellm.structured_output import StructuredOutputManager
            from pagellm.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(config.tokenizer or spec.model_path)
            structured_output = StructuredOutputManager(tokenizer, hf_config.vocab_size, spec.eos_token_ids)
        # CUDA graphs around collectives are not attempted: ranks run eagerly.
        self.runner = ModelRunner(
            model,
            kv_caches,
            config.block_size,
            config.max_num_seqs,
            spec.max_model_len,
            hf_config.vocab_size,
            True,
            structured_output,
            config.calculate_kv_scales,
            kv_cache_layout=layout,
            drafter=NgramProposer.from_config(config.speculative_config),
            pooler_config=config.pooler_config,
        )
        logger.info(
            "rank %d/%d ready: q heads %d-%d, kv heads %d-%d, %d threads",
            rank,
            spec.world_size,
            shard.q_head_start,
            shard.q_head_start + shard.num_q_heads - 1,
            shard.kv_head_start,
            shard.kv_head_start + shard.num_kv_heads - 1,
            torch.get_num_threads(),
        )

    def execute(self, payload: bytes) -> Any:
        """One step from the pickled SchedulerOutput; rank 0 returns (output, timings), others None."""
        tp = get_tp_group()
        tp.comm_s = 0.0
        t0 = time.perf_counter()
        out = self.runner.execute_model(pickle.loads(payload))
        if self.rank != 0:
            return None
        timings = dict(self.runner.last_timings, comm=tp.comm_s, worker=time.perf_counter() - t0)
        return out, timings
