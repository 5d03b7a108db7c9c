"""Engine configuration: every knob a user can set, validated in one place.

An ``EngineConfig`` is what the user asked for (vLLM's ``EngineArgs``), frozen once validated.
What the engine then runs (dtypes, the linear layers' arithmetic, the memory plan, the parallel
layout) is decided from it and the model once, by ``pagellm.plan.resolve_config``.
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

import torch

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}

# --kv-cache-dtype names for the 8-bit formats (vLLM's, plus int8; pagellm.attention.kv_quant).
KV_CACHE_DTYPE_NAMES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
}

# What --quantization takes (pagellm.models.precision implements it).
QUANTIZATION_METHODS = ("gguf",)

LinearKind = Literal["float32", "bfloat16", "int8"]


@dataclass(frozen=True)
class LinearPrecision:
    """The resolved choice: ``kind`` for the weights that are GGUF blocks, ``fallback`` for the
    others (a GGUF file's float tensors, or every weight of a float checkpoint)."""

    kind: LinearKind = "float32"
    fallback: LinearKind = "float32"

    @property
    def exact(self) -> bool:
        return self.kind == "float32" and self.fallback == "float32"

    def describe(self) -> str:
        if self.kind == self.fallback:
            return self.kind
        return f"{self.kind} (GGUF blocks), {self.fallback} (other weights)"


# Float32 products throughout: the exact path, and what off-CPU devices report.
EXACT_LINEAR = LinearPrecision()


DEFAULT_KV_CACHE_MEMORY_BYTES = 2 << 30  # 2 GiB: ~46k tokens of SmolLM2-135M in fp32


def parse_dtype(dtype: Union[str, torch.dtype]) -> torch.dtype:
    """A dtype name -> torch dtype; "auto" is float32 here (the model's tensors on a CPU; a GPU
    engine then takes the model's own, and pagellm.models.precision the CPU's linear layers')."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.float32
    try:
        return _DTYPES[dtype.lower()]
    except (KeyError, AttributeError):
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(set(_DTYPES))}") from None


def parse_kv_cache_dtype(value: Union[str, torch.dtype]) -> torch.dtype:
    """A --kv-cache-dtype name (other than "auto") -> the cache's element type."""
    if isinstance(value, str) and value.lower() in KV_CACHE_DTYPE_NAMES:
        return KV_CACHE_DTYPE_NAMES[value.lower()]
    if value in KV_CACHE_DTYPE_NAMES.values():
        return value
    try:
        return parse_dtype(value)
    except ValueError:
        raise ValueError(
            f"unsupported kv_cache_dtype {value!r}; choose auto (the model's dtype), "
            "float16, bfloat16, float32, fp8 (= fp8_e4m3), fp8_e5m2 or int8"
        ) from None


def parse_memory_size(value: Union[str, int, float]) -> int:
    """'2GiB', '512MiB', '1.5GB', '1000000' -> bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)B?\s*", str(value), re.IGNORECASE)
    if not match:
        raise ValueError(f"cannot parse memory size {value!r}; use e.g. 2GiB, 512MiB or a byte count")
    number, unit, binary = float(match.group(1)), match.group(2).upper(), match.group(3)
    base = 1024 if binary or not unit else 1000
    return int(number * base ** " KMGT".index(unit or " "))


def model_dtype(hf_config: Any) -> torch.dtype:
    """The dtype a checkpoint's config names (``dtype``, formerly ``torch_dtype``).

    Float32 checkpoints stay float32; a config that names none (e.g. one rebuilt from a quantized
    GGUF) gets bfloat16, the type such models are trained and served in.
    """
    named = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    try:
        dtype = parse_dtype(named) if named is not None else torch.bfloat16
    except ValueError:
        return torch.bfloat16
    return dtype if dtype in (torch.float32, torch.float16, torch.bfloat16) else torch.bfloat16


def _is_auto(value: Union[str, torch.dtype]) -> bool:
    return isinstance(value, str) and value.lower() == "auto"


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@dataclass(frozen=True)
class EngineConfig:
    model: Optional[str] = None  # HF directory or GGUF file; None -> the packaged SmolLM2-135M-Instruct
    tokenizer: Optional[str] = None
    # vLLM's trust_remote_code and language_model_only, taken so that vLLM's commands and code run as
    # written; neither changes anything here: pagellm builds every architecture itself (it never runs
    # a checkpoint's own code) and loads only the language model of a multimodal checkpoint.
    trust_remote_code: bool = False
    language_model_only: bool = False
    served_model_name: Optional[str] = None
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: Optional[int] = None  # None -> the model's own limit
    kv_cache_memory_bytes: Optional[int] = None
    num_kv_blocks: Optional[int] = None
    enable_prefix_caching: bool = True
    # A hybrid model's recurrent state (docs/hybrid_models.md): slots from the KV budget (None:
    # planned), and how many tokens apart prefix caching checkpoints it.
    num_state_slots: Optional[int] = None
    state_checkpoint_interval: int = 256
    # vLLM's --mamba-cache-dtype: the element type of every recurrent state tensor, the convolutions'
    # input tails and (unless mamba_ssm_cache_dtype says otherwise) the recurrent matrices. "auto":
    # the tails in the activations' dtype (lossless), the matrices in float32.
    mamba_cache_dtype: Union[str, torch.dtype] = "auto"
    # vLLM's --mamba-ssm-cache-dtype: the element type of the recurrent matrices (Gated DeltaNet's
    # and Mamba-2's state). "auto" follows mamba_cache_dtype, float32 where that is auto too;
    # bfloat16 halves their slots and checkpoints and the bytes a decode step moves, and rounds a
    # state where it is written: once per decoded token or prefill chunk (docs/hybrid_models.md).
    mamba_ssm_cache_dtype: Union[str, torch.dtype] = "auto"
    # Keep the CPU kernels' packed weights on disk so that later starts map them instead of packing
    # (pagellm.kernels.pack_cache; PAGELLM_PACKED_WEIGHT_CACHE says where, or 0 for never).
    packed_weight_cache: bool = True
    seed: int = 0
    # "auto": the checkpoint's own dtype (bfloat16 for SmolLM2, and for a GGUF file). On a CPU the
    # tensors stay float32 and only the linear layers' products take it (bfloat16 dot products
    # where the CPU has them; pagellm.models.precision); float32 asks for the exact path.
    dtype: Union[str, torch.dtype] = "auto"
    # "gguf": a GGUF model's 4/8-bit weight blocks dotted with int8-quantized inputs. None:
    # that for a GGUF model under dtype "auto", else none.
    quantization: Optional[str] = None
    # The KV cache's element type; "auto" is the model's dtype on a GPU, and on a CPU bfloat16
    # when the linear layers run in low precision (else float32). float16 or bfloat16 under a
    # float32 model halves the cache's memory and the bytes decode attention reads; keys and values
    # are rounded once, on their way into the cache, and attention still runs in float32. The
    # 8-bit formats (fp8 = fp8_e4m3, fp8_e5m2, int8; pagellm.attention.kv_quant) halve it again.
    kv_cache_dtype: Union[str, torch.dtype] = "auto"
    # fp8 caches: measure each layer's k/v scales from the first step (vLLM's flag) instead of the
    # checkpoint's scales or 1.0.
    calculate_kv_scales: bool = False
    device: Optional[Union[str, torch.device]] = None
    attention_backend: Optional[str] = None  # None -> the fastest available
    max_waiting_requests: Optional[int] = None
    num_threads: Optional[int] = None
    # GPU only: the share of the device's memory the engine may fill (weights, activations and a
    # KV cache sized from what is free), unless kv_cache_memory_bytes or num_kv_blocks say otherwise.
    gpu_memory_utilization: float = 0.9
    # GPU only: run decode steps eagerly instead of replaying CUDA graphs (vLLM's name).
    enforce_eager: bool = False
    # Tensor parallelism: ranks that each hold a shard of every layer (by KV-head groups) and of
    # the KV cache. 1 keeps the model in the engine's own process ("uni").
    tensor_parallel_size: int = 1
    # How ranks run (vLLM's names): "mp" local processes, "ray" Ray actors; None -> "uni" for one
    # rank, "mp" for more.
    distributed_executor_backend: Optional[str] = None
    # Speculative decoding (vLLM's ``--speculative-config``): a dict, its JSON, or None for none.
    speculative_config: Optional[Any] = None
    # Reasoning models (vLLM's names): the parser that finds the thinking in the output (grammars and
    # forced tool calls wait for its end; ``thinking_token_budget`` forces the end), and for the
    # generic parser its strings: {"reasoning_start_str": ..., "reasoning_end_str": ...} or its JSON.
    reasoning_parser: Optional[str] = None
    reasoning_config: Optional[Any] = None
    # A second tier under the prefix cache (vLLM's names): blocks evicted from the KV budget are
    # kept in host memory, or with ``kv_offloading_dir`` in files that outlive the server, up to
    # ``kv_offloading_size`` GiB, and loaded back instead of recomputed (docs/kv_offloading.md).
    kv_offloading_backend: Optional[str] = None
    kv_offloading_size: Optional[float] = None
    kv_offloading_dir: Optional[str] = None
    # vLLM's ``--runner``: "generate" samples tokens, "pooling" prefills prompts into embeddings
    # (``task="embed"``, older vLLM's name, means the same); ``pooler_config`` (vLLM's JSON or a
    # dict) how: pagellm.pooling_params.PoolerConfig.
    runner: Optional[str] = None
    task: Optional[str] = None
    pooler_config: Optional[Any] = None
    # Multi-LoRA serving (vLLM's names; docs/lora.md): adapters in flight at once (slots), their
    # largest rank, and adapters kept loaded in host memory (default: max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None
    # The slots' element type (vLLM's --lora-dtype): "auto" is bfloat16 under low-precision linear
    # layers (it halves what each step reads of its adapters) and float32 on the exact path.
    lora_dtype: Union[str, torch.dtype] = "auto"
    def _set(self, name: str, value: Any) -> None:
        """Validation normalises a field while the config is built; afterwards it is never edited."""
        object.__setattr__(self, name, value)

    def __post_init__(self) -> None:
        # Dtype names are normalised to torch dtypes; "auto" stays "auto", for the resolution
        # (pagellm.models.precision) to decide from the model and the machine, also in a copy
        # made with dataclasses.replace.
        if self.quantization is not None:
            self._set("quantization", str(self.quantization).lower())
            if self.quantization not in QUANTIZATION_METHODS:
                raise ValueError(f"unsupported quantization {self.quantization!r}; choose one of {list(QUANTIZATION_METHODS)}")
        if not self.auto_dtype:
            self._set("dtype", parse_dtype(self.dtype))
        if not self.auto_kv_cache_dtype:
            self._set("kv_cache_dtype", parse_kv_cache_dtype(self.kv_cache_dtype))
        self._set("device", torch.device(self.device) if self.device is not None else default_device())
        if self.kv_cache_memory_bytes is not None:
            self._set("kv_cache_memory_bytes", parse_memory_size(self.kv_cache_memory_bytes))
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.block_size > 1024 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two up to 1024, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be positive, got {self.num_kv_blocks}")
        if self.num_state_slots is not None and self.num_state_slots < 2:
            raise ValueError(f"num_state_slots must be at least 2, got {self.num_state_slots}")
        for name in ("mamba_cache_dtype", "mamba_ssm_cache_dtype"):
            value = getattr(self, name)
            if _is_auto(value):
                continue
            try:
                state_dtype = parse_dtype(value)
            except ValueError:
                state_dtype = None
            if state_dtype not in (torch.float32, torch.bfloat16):
                raise ValueError(f"{name} must be auto, float32 or bfloat16, got {value!r}")
            self._set(name, state_dtype)
        if self.state_checkpoint_interval < self.block_size:
            raise ValueError(f"state_checkpoint_interval must be at least the block size, got {self.state_checkpoint_interval}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError("kv_cache_memory_bytes must be positive")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError("max_waiting_requests must be positive")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if self.distributed_executor_backend is None:
            self._set("distributed_executor_backend", "uni" if self.tensor_parallel_size == 1 else "mp")
        if self.distributed_executor_backend not in ("uni", "mp", "ray"):
            raise ValueError(
                f"distributed_executor_backend must be mp or ray (uni: one rank), got {self.distributed_executor_backend!r}"
            )
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size > 1:
            raise ValueError("the uni executor runs one rank; use mp or ray for tensor_parallel_size > 1")
        from pagellm.speculative_config import SpeculativeConfig

        self._set("speculative_config", SpeculativeConfig.parse(self.speculative_config))
        self._check_reasoning()
        self._check_offloading()
        self._resolve_pooling()
        self._check_lora()
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    def _check_offloading(self) -> None:
        backend, size, directory = self.kv_offloading_backend, self.kv_offloading_size, self.kv_offloading_dir
        if backend is None:
            if size is not None or directory is not None:
                raise ValueError("kv_offloading_size and kv_offloading_dir need kv_offloading_backend='native'")
            return
        if backend != "native":
            raise ValueError(f"kv_offloading_backend must be 'native', got {backend!r}")
        if size is None or not size > 0:
            raise ValueError(f"kv_offloading_backend needs kv_offloading_size, a positive number of GiB, got {size!r}")
        if not self.enable_prefix_caching:
            raise ValueError("KV offloading keeps prefix-cache blocks: it needs prefix caching on")

    def _check_reasoning(self) -> None:
        config = self.reasoning_config
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except ValueError as e:
                raise ValueError(f"reasoning_config is not valid JSON: {e}") from None
        if config is not None:
            if not isinstance(config, dict) or not all(isinstance(v, str) for v in config.values()):
                raise ValueError(f"reasoning_config must map names to strings, got {config!r}")
            unknown = set(config) - {"reasoning_start_str", "reasoning_end_str"}
            if unknown:
                raise ValueError(f"reasoning_config: unknown keys {sorted(unknown)}; known: reasoning_start_str, reasoning_end_str")
            self._set("reasoning_config", dict(config))

    def _resolve_pooling(self) -> None:
        from pagellm.pooling_params import PoolerConfig, resolve_runner

        self._set("runner", resolve_runner(self.runner, self.task))
        self._set("task", None)
        if self.runner != "pooling":
            if self.pooler_config is not None:
                raise ValueError("pooler_config needs runner='pooling'")
            return
        self._set("pooler_config", PoolerConfig.parse(self.pooler_config))
        if self.speculative_config is not None:
            raise ValueError("the pooling runner generates no tokens; speculative_config does not apply")
        if self.enable_prefix_caching and not self.pooler_config.supports_prefix_caching:
            logger.info("prefix caching is off: %s pooling reads positions a cache hit would skip", self.pooler_config.pooling_type)
            self._set("enable_prefix_caching", False)

    @property
    def model_name(self) -> str:
        """The name the model is served and reported under."""
        return self.served_model_name or self.model or "SmolLM2-135M-Instruct"

    @property
    def auto_dtype(self) -> bool:
        return _is_auto(self.dtype)

    @property
    def auto_kv_cache_dtype(self) -> bool:
        return _is_auto(self.kv_cache_dtype)

    @property
    def auto_lora_dtype(self) -> bool:
        return _is_auto(self.lora_dtype)

    @property
    def auto_mamba_cache_dtype(self) -> bool:
        return _is_auto(self.mamba_cache_dtype)

    @property
    def auto_mamba_ssm_cache_dtype(self) -> bool:
        return _is_auto(self.mamba_ssm_cache_dtype)

    @property
    def is_pooling(self) -> bool:
        return self.runner == "pooling"

    def _check_lora(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_cpu_loras is None:
            self._set("max_cpu_loras", self.max_loras)
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if not self.auto_lora_dtype:
            self._set("lora_dtype", parse_dtype(self.lora_dtype))
        if not self.auto_lora_dtype and self.lora_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"lora_dtype must be auto, float32 or bfloat16, got {self.lora_dtype}")
        if self.enable_lora and self.runner == "pooling":
            raise ValueError("LoRA adapters serve the generate runner; enable_lora does not apply to runner='pooling'")
