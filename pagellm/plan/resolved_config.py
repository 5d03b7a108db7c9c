"""The configuration an engine runs, resolved once from the user's ``EngineConfig`` and the model,
before anything large loads, then frozen (vLLM's ``VllmConfig``).

Every decision that depends on the checkpoint or the machine is taken here and nowhere else: the
model's tensors' dtype, the linear layers' arithmetic, the KV cache's and LoRA slots' dtypes, the
attention backend, the context length, the parallel layout, the KV cache's blocks and the memory
plan. The executor's workers and the engine core receive the result and only read it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from pagellm.attention.kv_quant import kv_cache_dtype_name
from pagellm.attention.selector import get_attn_backend
from pagellm.config import EngineConfig, LinearPrecision, model_dtype
from pagellm.distributed.partition import check_tp_size
from pagellm.models.loader import (
    checkpoint_files,
    default_model_path,
    get_max_model_len,
    is_gguf,
    load_hf_config,
    resolve_model_path,
)
from pagellm.models.precision import ResolvedPrecision, draft_linear_precision, resolve_precision
from pagellm.models.shape import ModelShape
from pagellm.plan.kv_cache_plan import KVCachePlan, kv_cache_layout_for, plan_kv_cache
from pagellm.plan.memory_plan import MemoryPlan, available_memory_bytes, estimate_weight_bytes
from pagellm.worker.kv_cache import activation_reserve_bytes

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """A checkpoint as read before loading: where it is, its config, its shape, its stored dtype."""

    path: str  # as given (an HF directory or a GGUF file)
    hf_config: Any
    shape: ModelShape
    checkpoint_dtype: torch.dtype
    is_gguf: bool

    @classmethod
    def read(cls, model_path: str) -> ModelSpec:
        hf_config = load_hf_config(model_path)
        gguf = is_gguf(resolve_model_path(model_path))
        return cls(model_path, hf_config, ModelShape.from_hf_config(hf_config), model_dtype(hf_config), gguf)


@dataclass(frozen=True)
class ResolvedConfig:
    args: EngineConfig  # what the user asked for, its dtypes replaced by the resolved ones
    model: ModelSpec
    precision: ResolvedPrecision
    attention_backend: str
    kv_cache: KVCachePlan
    memory: MemoryPlan  # the estimate checked before loading
    model_max_len: int  # the longest context the model supports (the KV cache plan may hold less)
    # On an accelerator with no budget given, the KV cache takes what the weights leave free; the
    # engine core plans it again once they are loaded (``kv_cache`` then holds the default budget's plan).
    kv_cache_from_free_memory: bool = False
    draft: Optional[ModelSpec] = None
    draft_linear: Optional[LinearPrecision] = None

    @property
    def device(self) -> torch.device:
        return self.args.device

    @property
    def tensor_parallel_size(self) -> int:
        return self.args.tensor_parallel_size

    def describe_attention(self) -> str:
        if self.tensor_parallel_size == 1:
            return self.attention_backend
        return f"{self.attention_backend} on {self.tensor_parallel_size} ranks ({self.args.distributed_executor_backend})"


def resolve_config(config: EngineConfig) -> ResolvedConfig:
    """Reads the model's config (not its weights) and decides everything; ValueError for what
    cannot run, including a plan that does not fit in memory."""
    model = ModelSpec.read(config.model or default_model_path())
    draft = _read_draft(config, model.shape)
    return resolve_with_model(config, model, draft)


def resolve_with_model(
    config: EngineConfig,
    model: ModelSpec,
    draft: Optional[ModelSpec] = None,
    max_model_len: Optional[int] = None,
    check_memory: bool = True,
) -> ResolvedConfig:
    """``resolve_config`` for a model already read (``max_model_len``: its limit, if not its
    config's); ``check_memory=False`` for a model already loaded, whose weights the machine's
    available memory no longer counts."""
    if config.tensor_parallel_size > 1:
        hf = model.hf_config
        check_tp_size(config.tensor_parallel_size, hf.num_attention_heads, model.shape.num_kv_heads, hf.intermediate_size)
    spec = config.speculative_config
    if model.shape.is_hybrid and spec is not None and spec.method != "ngram":
        raise ValueError(
            f"speculative method {spec.method!r} is not supported for hybrid models (recurrent layers such as Gated DeltaNet "
            "or Mamba): a draft model's KV shares the blocks of a target whose layers all attend in full; use 'ngram'"
        )
    model_max_len = max_model_len or get_max_model_len(model.hf_config)
    if config.max_model_len is not None and config.max_model_len > model_max_len:
        raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's limit of {model_max_len}")
    precision = resolve_precision(config, model.checkpoint_dtype, model.is_gguf)
    args = replace(config, dtype=precision.dtype, kv_cache_dtype=precision.kv_cache_dtype, lora_dtype=precision.lora_dtype)
    kv_cache = plan_kv_cache(
        args,
        model.shape,
        precision.kv_cache_dtype,
        config.max_model_len or model_max_len,
        kv_cache_layout_for(model.shape),
        draft.shape if draft is not None else None,
        conv_state_dtype=precision.conv_state_dtype,
        ssm_state_dtype=precision.ssm_state_dtype,
    )
    from_free_memory = config.device.type == "cuda" and config.kv_cache_memory_bytes is None and config.num_kv_blocks is None
    memory = _plan_memory(args, model, precision, kv_cache)
    if check_memory:
        logger.info("memory plan: %s", memory.describe())
        memory.check()
    draft_linear = None
    if draft is not None:
        draft_linear = draft_linear_precision(config.device, draft.checkpoint_dtype, draft.is_gguf)
    return ResolvedConfig(
        args=args,
        model=model,
        precision=precision,
        attention_backend=get_attn_backend(config.attention_backend, config.device).name,
        kv_cache=kv_cache,
        memory=memory,
        model_max_len=model_max_len,
        kv_cache_from_free_memory=from_free_memory,
        draft=draft,
        draft_linear=draft_linear,
    )


def _read_draft(config: EngineConfig, target: ModelShape) -> Optional[ModelSpec]:
    """The speculative draft checkpoint, checked against the target before either loads."""
    spec = config.speculative_config
    if spec is None or spec.method != "draft_model":
        return None
    if config.tensor_parallel_size > 1:
        raise ValueError("a speculative draft model runs with tensor_parallel_size 1; use 'ngram' under tensor parallelism")
    draft = ModelSpec.read(spec.model)
    if draft.shape.vocab_size != target.vocab_size:
        raise ValueError(
            f"the draft model {spec.model!r} has a vocabulary of {draft.shape.vocab_size} tokens, the target {target.vocab_size}: "
            "a draft must share the target's tokenizer"
        )
    if any(w is not None for w in draft.shape.layer_sliding_windows):
        raise ValueError("a draft model with sliding-window layers is not supported; use a full-attention draft")
    return draft


def _plan_memory(config: EngineConfig, model: ModelSpec, precision: ResolvedPrecision, kv_cache: KVCachePlan) -> MemoryPlan:
    """What the weights, the KV cache and a step's activations will take, before any is allocated."""
    hf_config = model.hf_config
    files = checkpoint_files(model.path) if model.path else []
    file_bytes, weight_bytes = estimate_weight_bytes(files, precision.linear, model.is_gguf) if files else (0, 0)
    activations = activation_reserve_bytes(
        config.max_num_batched_tokens,
        config.max_num_seqs,
        hf_config.hidden_size,
        getattr(hf_config, "intermediate_size", 4 * hf_config.hidden_size),
        model.shape.vocab_size,
        torch.empty((), dtype=precision.dtype).element_size(),
    )
    available = available_memory_bytes() if config.device.type == "cpu" else None
    layout = kv_cache.layout
    return MemoryPlan(
        file_bytes,
        weight_bytes,
        kv_cache.num_bytes,
        activations,
        available,
        kv_cache.num_tokens,
        kv_cache_dtype=kv_cache_dtype_name(precision.kv_cache_dtype),
        kv_cache_layout="" if layout.plain else layout.describe(),
        state_bytes=kv_cache.state_bytes,
        num_state_slots=kv_cache.num_state_slots,
    )
