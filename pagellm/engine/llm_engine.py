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
from typing import Iterable, Optional

import torch

from pagellm.attention.kv_quant import kv_cache_dtype_name
from pagellm.config import EngineConfig
from pagellm.core.kv_cache_base import KVCacheManagerBase
from pagellm.core.scheduler import Scheduler
from pagellm.engine.engine_core import EngineCore
from pagellm.engine.input_processor import InputProcessor, ProcessedPrompt, PromptType
from pagellm.engine.output_processor import OutputProcessor, RequestOutputKind
from pagellm.engine.stats import EngineStats
from pagellm.executor.factory import create_executor
from pagellm.lora.request import LoRARequest
from pagellm.models.loader import eos_token_ids
from pagellm.models.shape import ModelShape
from pagellm.outputs import EmbeddingRequestOutput, RequestOutput
from pagellm.plan.memory_plan import MemoryPlan
from pagellm.plan.resolved_config import resolve_config, resolve_with_model
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams
from pagellm.structured_output import StructuredOutputManager
from pagellm.structured_output.reasoning import reasoning_bounds
from pagellm.tokenizer import load_tokenizer, turn_end_token_ids

logger = logging.getLogger(__name__)


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
        t0 = time.perf_counter()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        self.config = config
        # Everything that depends on the model and the machine, decided before anything large loads.
        self.resolved = resolved = resolve_config(config)
        # Built beside the weights: its conversion is Python, their packing native code that lets
        # go of the interpreter, so the two overlap.
        tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagellm-tokenizer")
        tokenizer_future = tokenizer_pool.submit(load_tokenizer, config.tokenizer or resolved.model.path)
        tokenizer_pool.shutdown(wait=False)
        # The in-process worker loads beside the tokenizer; remote ranks start once the stop tokens
        # are known (their rank 0 masks grammars).
        in_process = resolved.args.distributed_executor_backend == "uni"
        executor = create_executor(resolved, set()) if in_process else None
        self.tokenizer = tokenizer_future.result()
        self.eos_token_ids = eos_token_ids(resolved.model.path, resolved.model.hf_config, self.tokenizer)
        if resolved.model.is_gguf:
            self.eos_token_ids |= turn_end_token_ids(self.tokenizer)  # what generation_config.json would list
        executor = executor or create_executor(resolved, self.eos_token_ids)
        # Shared by the input processor (compiles, refusing bad grammars) and an in-process runner (masks).
        bounds = reasoning_bounds(self.tokenizer, config.reasoning_parser, resolved.args.reasoning_config)
        self.structured_output = StructuredOutputManager(self.tokenizer, self.shape.vocab_size, self.eos_token_ids, bounds)
        self.core = EngineCore(resolved, executor, structured_output=self.structured_output)
        self.max_model_len = self.core.max_model_len  # may be lowered to what the KV cache holds
        self.memory_plan = self._measured_memory_plan()
        self.input_processor = InputProcessor(
            self.tokenizer, self.max_model_len, self.shape.vocab_size, self.eos_token_ids, self.structured_output
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()
        self.load_time_s = time.perf_counter() - t0
        logger.info("memory: %s", self.memory_plan.describe())
        logger.info(
            "engine ready in %.1f s: %s, linear layers %s, KV cache %s, attention %s",
            self.load_time_s,
            resolved.model.path,
            resolved.precision.linear.describe(),
            kv_cache_dtype_name(resolved.precision.kv_cache_dtype),
            resolved.describe_attention(),
        )

    @property
    def model_path(self) -> str:
        return self.resolved.model.path

    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def hf_config(self):
        return self.resolved.model.hf_config

    @property
    def shape(self) -> ModelShape:
        return self.resolved.model.shape

    @property
    def model(self) -> Optional[torch.nn.Module]:
        """The in-process worker's model (None when tensor-parallel ranks hold the shards)."""
        worker = getattr(self.core.executor, "worker", None)
        return worker.model if worker is not None else None

    def _measured_memory_plan(self) -> MemoryPlan:
        """The resolved estimate with what loading measured: resident weights (in-process) and the KV cache."""
        plan = self.resolved.memory
        model = self.model
        return replace(
            plan,
            weight_bytes=model.weight_bytes() if model is not None else plan.weight_bytes,
            kv_cache_bytes=self.core.kv_cache_bytes,
            kv_cache_tokens=self.core.kv_cache_tokens,
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
        """A fresh core (KV cache, scheduler, the workers' runners) around the same loaded model,
        with no request in flight; ``config`` may change only what needs no reload (block size, budget, batch limits).

        For benchmarks that compare designs or block sizes without loading the model again.
        """
        if self.has_unfinished_requests():
            raise RuntimeError("cannot rebuild the engine core while requests are in flight")
        resolved = resolve_with_model(config, self.resolved.model, self.resolved.draft, check_memory=False)
        if (resolved.precision, resolved.attention_backend, resolved.tensor_parallel_size) != (
            self.resolved.precision,
            self.resolved.attention_backend,
            self.resolved.tensor_parallel_size,
        ):
            raise ValueError("rebuild_core keeps the loaded model: its precision, attention backend and ranks cannot change")
        # Drop the old cache first: two full KV budgets at once may not fit in memory.
        executor = self.core.executor
        executor.release_kv_cache()
        self.core = None
        gc.collect()
        self.core = EngineCore(resolved, executor, kv_cache_manager, scheduler_cls, self.structured_output)
        self.config, self.resolved = config, resolved
        self.memory_plan = self._measured_memory_plan()
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
