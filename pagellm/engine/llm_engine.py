"""The synchronous engine: prompts in, ``RequestOutput``s out, one ``step()`` at a time.

It ties the front end (tokenizer, input validation, detokenization) to the engine core. The
offline ``LLM`` drives it in a loop; the async engine drives it from a background thread.
"""
from __future__ import annotations

import concurrent.futures
import gc
import itertools
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Iterable, Optional

import torch

from pagellm.attention.kv_quant import kv_cache_dtype_name
from pagellm.config import DEFAULT_KV_CACHE_MEMORY_BYTES, EngineConfig, LinearPrecision, model_dtype
from pagellm.core.kv_cache_base import KVCacheManagerBase
from pagellm.core.kv_cache_groups import group_layers
from pagellm.core.scheduler import Scheduler
from pagellm.engine.engine_core import EngineCore
from pagellm.engine.input_processor import InputProcessor, ProcessedPrompt, PromptType
from pagellm.engine.output_processor import OutputProcessor, RequestOutputKind
from pagellm.engine.stats import EngineStats
from pagellm.lora.request import LoRARequest
from pagellm.models.shape import ModelShape
from pagellm.outputs import EmbeddingRequestOutput, RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams
from pagellm.structured_output import StructuredOutputManager
from pagellm.worker.kv_cache import activation_reserve_bytes, bytes_per_block

if TYPE_CHECKING:
    from pagellm.engine.memory_plan import MemoryPlan

logger = logging.getLogger(__name__)


def plan_memory(
    config: EngineConfig, model_path: str, hf_config, shape: ModelShape, precision: LinearPrecision
) -> MemoryPlan:
    """What the model, its KV cache and a step's activations will take, before any is allocated."""
    from pagellm.engine.memory_plan import MemoryPlan, available_memory_bytes, estimate_weight_bytes
    from pagellm.models.loader import checkpoint_files, is_gguf, resolve_model_path

    files = checkpoint_files(model_path)
    file_bytes, weight_bytes = estimate_weight_bytes(files, precision, is_gguf(resolve_model_path(model_path)))
    layout = group_layers(shape.layer_sliding_windows)  # a block is one group's page: group_size layers
    block_bytes = bytes_per_block(layout.group_size, config.block_size, shape.num_kv_heads, shape.head_dim, config.kv_cache_dtype)
    if config.num_kv_blocks is not None:
        kv_bytes = config.num_kv_blocks * block_bytes
    else:
        kv_bytes = config.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES
        kv_bytes -= kv_bytes % block_bytes
    activations = activation_reserve_bytes(
        config.max_num_batched_tokens,
        config.max_num_seqs,
        hf_config.hidden_size,
        getattr(hf_config, "intermediate_size", 4 * hf_config.hidden_size),
        shape.vocab_size,
        4,
    )
    available = available_memory_bytes() if config.device.type == "cpu" else None
    num_blocks = kv_bytes // block_bytes
    kv_tokens = (num_blocks - layout.num_reserved_blocks) // layout.num_groups * config.block_size
    described = "" if layout.plain else layout.describe()
    return MemoryPlan(file_bytes, weight_bytes, kv_bytes, activations, available, kv_tokens, kv_cache_layout=described)


def child_params(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """The ``n`` core requests behind one user request, as vLLM forms them.

    A seeded request gives sample ``i`` the seed ``seed + i``, so the samples differ from each
    other yet the whole request stays reproducible.
    """
    if params.n == 1:
        return [(request_id, params)]
    children = []
    for i in range(params.n):
        p = params.clone()
        p.n = 1
        if params.seed is not None:
            p.seed = params.seed + i
        children.append((f"{i}_{request_id}", p))
    return children


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        from pagellm.attention.selector import get_attn_backend
        from pagellm.distributed.partition import check_tp_size
        from pagellm.executor.factory import create_executor
        from pagellm.models.loader import (
            default_model_path,
            eos_token_ids,
            get_max_model_len,
            is_gguf,
            load_hf_config,
            load_model_for_engine,
            resolve_model_path,
        )
        from pagellm.models.precision import resolve_linear_precision
        from pagellm.tokenizer import load_tokenizer

        t0 = time.perf_counter()
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        model_path = config.model or default_model_path()
        self.model_path = model_path
        self.model_name = config.model_name
        self.hf_config = load_hf_config(model_path)
        config.apply_model_dtype(model_dtype(self.hf_config))
        precision = resolve_linear_precision(config, model_dtype(self.hf_config), is_gguf(resolve_model_path(model_path)))
        # Built beside the weights: its conversion is Python, their packing native code that lets
        # go of the interpreter, so the two overlap (about half a second of a 1-2B GGUF's start).
        tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagellm-tokenizer")
        tokenizer_future = tokenizer_pool.submit(load_tokenizer, config.tokenizer or model_path)
        tokenizer_pool.shutdown(wait=False)
        model_max_len = get_max_model_len(self.hf_config)
        if config.max_model_len is not None and config.max_model_len > model_max_len:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's limit of {model_max_len}")
        self.max_model_len = config.max_model_len or model_max_len
        self.shape = ModelShape.from_hf_config(self.hf_config)
        self.cpu_tuning = None
        # Checked before anything large is allocated: a model that cannot fit is refused here.
        plan = plan_memory(config, model_path, self.hf_config, self.shape, precision)
        logger.info("memory plan: %s", plan.describe())
        plan.check()
        if config.distributed_executor_backend == "uni":
            attn_backend = get_attn_backend(config.attention_backend, config.device)
            model, self.cpu_tuning = load_model_for_engine(config, model_path, self.hf_config, attn_backend)
            attn_name = attn_backend.name
            self.model = model
            self._executor_factory = None
        draft = None
        spec = config.speculative_config
        if spec is not None and spec.method == "draft_model":
            if config.distributed_executor_backend != "uni":
                raise ValueError("a speculative draft model runs with tensor_parallel_size 1; use 'ngram' under tensor parallelism")
            from pagellm.spec_decode.draft_model import load_draft_model

            draft = load_draft_model(config, spec.model, attn_backend, self.shape.vocab_size)
        self.tokenizer = tokenizer_future.result()
        self.eos_token_ids = eos_token_ids(model_path, self.hf_config, self.tokenizer)
        if config.distributed_executor_backend != "uni":
            # Tensor parallelism: the ranks load their own shards; this process keeps the scheduler.
            hf = self.hf_config
            check_tp_size(
                config.tensor_parallel_size,
                hf.num_attention_heads,
                self.shape.num_kv_heads,
                hf.intermediate_size,
            )
            self.model = None
            tp, backend = config.tensor_parallel_size, config.distributed_executor_backend
            attn_name = f"{config.attention_backend or 'default'} on {tp} ranks ({backend})"
            eos = self.eos_token_ids

            def executor_factory(num_blocks: int, max_len: int):
                return create_executor(config, model_path, num_blocks, max_len, eos)

            self._executor_factory = executor_factory
        # Shared by the input processor (compiles, refusing bad grammars) and the runner (masks).
        self.structured_output = StructuredOutputManager(self.tokenizer, self.shape.vocab_size, self.eos_token_ids)
        self.core = EngineCore(
            config,
            self.model,
            self.shape,
            self.max_model_len,
            executor_factory=self._executor_factory,
            structured_output=self.structured_output,
            draft=draft,
        )
        self.max_model_len = self.core.max_model_len  # may be lowered to what the KV cache holds
        self.memory_plan = replace(
            plan,
            weight_bytes=self.model.weight_bytes() if self.model is not None else plan.weight_bytes,
            kv_cache_bytes=self.core.kv_cache_bytes,
            kv_cache_tokens=self.core.kv_cache_tokens,
            kv_cache_dtype=kv_cache_dtype_name(config.kv_cache_dtype),
        )
        logger.info("memory: %s", self.memory_plan.describe())
        self.input_processor = InputProcessor(
            self.tokenizer, self.max_model_len, self.shape.vocab_size, self.eos_token_ids, self.structured_output
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()
        self.load_time_s = time.perf_counter() - t0
        logger.info(
            "engine ready in %.1f s: %s, linear layers %s, KV cache %s, attention %s",
            self.load_time_s,
            model_path,
            precision.describe(),
            kv_cache_dtype_name(config.kv_cache_dtype),
            attn_name,
        )

    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def process_prompt(self, prompt: PromptType, params: SamplingParams | PoolingParams) -> ProcessedPrompt:
        self.check_runner(params)
        if isinstance(params, PoolingParams):
            params.resolved(self.config.pooler_config, self.hf_config.hidden_size)  # refuses a bad dimensions now
            return self.input_processor.process_for_pooling(prompt)
        return self.input_processor.process(prompt, params)

    def check_runner(self, params: SamplingParams | PoolingParams) -> None:
        """Pooling requests need the pooling runner, and generation the generate runner."""
        if isinstance(params, PoolingParams) and not self.config.is_pooling:
            raise ValueError("this engine runs the generate runner and does not support embeddings; start it with runner='pooling'")
        if isinstance(params, SamplingParams) and self.config.is_pooling:
            raise ValueError("this engine runs the pooling runner (embeddings only) and does not generate; start it with runner='generate'")

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams,
        output_kind: RequestOutputKind = RequestOutputKind.FINAL_ONLY,
        arrival_time: Optional[float] = None,
        processed: Optional[ProcessedPrompt] = None,
        lora_request: Optional[LoRARequest] = None,
    ) -> None:
        processed = processed or self.process_prompt(prompt, params)
        if isinstance(params, PoolingParams):
            if lora_request is not None:
                raise ValueError("a pooling request takes no LoRA adapter")
            self._add_pooling_request(request_id, processed, params, output_kind, arrival_time)
            return
        if lora_request is not None:
            self.add_lora(lora_request)
        params = params.clone()  # the engine fills in stop tokens; the caller's object stays as given
        params.update_from_generation_config(self.eos_token_ids)
        arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        children = child_params(request_id, params)
        self.output_processor.add_request(
            request_id, processed.prompt, processed.prompt_token_ids, children, output_kind, arrival_time
        )
        for core_id, p in children:
            self.core.add_request(
                self.core.make_request(
                    core_id,
                    processed.prompt_token_ids,
                    p,
                    processed.max_tokens,
                    arrival_time=arrival_time,
                    cache_salt=processed.cache_salt,
                    lora_request=lora_request,
                )
            )

    def _add_pooling_request(
        self,
        request_id: str,
        processed: ProcessedPrompt,
        params: PoolingParams,
        output_kind: RequestOutputKind,
        arrival_time: Optional[float],
    ) -> None:
        """One core request that prefills its prompt and samples nothing (max_tokens 0)."""
        pooling_params = params.resolved(self.config.pooler_config, self.hf_config.hidden_size)
        prefill_only = SamplingParams(max_tokens=0, temperature=0.0)
        arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.output_processor.add_request(
            request_id, processed.prompt, processed.prompt_token_ids, [(request_id, prefill_only)], output_kind, arrival_time, pooling=True
        )
        self.core.add_request(
            self.core.make_request(
                request_id,
                processed.prompt_token_ids,
                prefill_only,
                0,
                arrival_time=arrival_time,
                cache_salt=processed.cache_salt,
                pooling_params=pooling_params,
            )
        )

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Loads and checks an adapter (vLLM's ``add_lora``); ValueError if it cannot be served."""
        self.core.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.core.remove_lora(lora_int_id)

    def abort_request(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Ends requests now; returns the final output (finish_reason "abort") of each one known."""
        finals = []
        for request_id in request_ids:
            core_ids, final = self.output_processor.abort_request(request_id)
            self.core.abort_requests(core_ids)
            if final is not None:
                finals.append(final)
        return finals

    def prefault_kv_cache(self) -> bool:
        """Faults in one more slice of the KV cache's memory, for idle time; whether any remain."""
        return self.core.prefault_kv_cache()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or self.output_processor.has_unfinished_requests()

    def stats(self) -> EngineStats:
        return self.core.stats()

    def kv_cache_view(self) -> tuple[KVCacheManagerBase, Scheduler]:
        """The KV cache manager and scheduler, for read-only introspection (the dashboard, the
        block-map benchmark) on the thread that steps the engine, between steps."""
        return self.core.kv_cache_manager, self.core.scheduler

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block not in use; False if some are still held by requests."""
        return self.core.reset_prefix_cache()

    def rebuild_core(
        self, config: EngineConfig, kv_cache_manager: str = "paged", scheduler_cls: type[Scheduler] = Scheduler
    ) -> EngineCore:
        """A fresh core (KV cache, scheduler, runner) around the same model, with no request in flight.

        For benchmarks that compare designs or block sizes without loading the model again.
        """
        if self.has_unfinished_requests():
            raise RuntimeError("cannot rebuild the engine core while requests are in flight")
        # Drop the old cache first: two full KV budgets at once may not fit in memory.
        self.core.shutdown()
        self.core = None
        gc.collect()
        self.core = EngineCore(
            config,
            self.model,
            self.shape,
            self.max_model_len,
            kv_cache_manager,
            scheduler_cls,
            self._executor_factory,
            self.structured_output,
        )
        self.config = config
        return self.core

    def check_health(self) -> None:
        """Raises if a tensor-parallel rank is gone."""
        self.core.executor.check_health()

    def shutdown(self) -> None:
        """Stops the tensor-parallel ranks, if any; the engine is unusable afterwards."""
        if self.core is not None:
            self.core.shutdown()

    def step(self) -> list[RequestOutput | EmbeddingRequestOutput]:
        core_outputs = self.core.step()
        ready, to_abort = self.output_processor.process_outputs(core_outputs)
        if to_abort:
            self.core.abort_requests(to_abort)
        return ready
