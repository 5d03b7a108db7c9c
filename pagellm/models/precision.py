"""Which arithmetic a CPU engine's linear layers use: float32, bfloat16 or int8 dot products.

On a CPU the model's tensors (activations, norms, attention, the residual stream) stay float32;
only the products of the linear layers change. ``bfloat16`` rounds weights and inputs to bfloat16
and accumulates in float32 (AVX512_BF16's ``vdpbf16ps``); ``int8`` keeps a GGUF model's 4- and
8-bit weight blocks as they are and quantizes the inputs to int8 per 32-input block on the fly
(VNNI's ``vpdpbusd``, or AVX2's ``vpmaddubsw``: llama.cpp's approach). Both need their instructions: where the CPU lacks
them the layers run in float32, which is also what ``--dtype float32`` asks for (exact).

Defaults follow vLLM: ``--dtype auto`` is the checkpoint's own dtype (bfloat16 for most models,
and for a GGUF file, whose config names none), and a GGUF model is served with
``--quantization gguf``, i.e. by its blocks, unless ``--dtype float32`` asks for exactness.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

from pagellm.config import EXACT_LINEAR, EngineConfig, LinearKind, LinearPrecision, parse_dtype
from pagellm.kernels import ops

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedPrecision:
    """What an engine computes in, decided once: the linear layers' arithmetic, the model's tensors,
    the KV cache, the LoRA slots and a hybrid model's state: its recurrent matrices (the SSM state)
    and its convolutions' input tails."""

    linear: LinearPrecision
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    lora_dtype: torch.dtype
    ssm_state_dtype: torch.dtype
    conv_state_dtype: torch.dtype


def resolve_precision(config: EngineConfig, checkpoint_dtype: torch.dtype, is_gguf: bool) -> ResolvedPrecision:
    """The arithmetic of this model on ``config.device``. ``checkpoint_dtype`` is what the
    checkpoint names. On a CPU the tensors stay float32 whatever the linear layers compute in (a
    requested bfloat16 goes to the products only), and an "auto" KV cache is bfloat16 under
    low-precision products, where decode attention reads half the bytes; on an accelerator "auto"
    is the model's own dtype. ValueError for ``quantization="gguf"`` on a model that is not GGUF."""
    if config.quantization == "gguf" and not is_gguf:
        raise ValueError("quantization='gguf' needs a GGUF model file")
    dtype = parse_dtype(config.dtype)  # "auto" is float32 until the device's rules below
    kv_cache_dtype = dtype if config.auto_kv_cache_dtype else config.kv_cache_dtype
    if config.device.type != "cpu":
        linear = EXACT_LINEAR
        if config.auto_dtype:
            dtype = checkpoint_dtype
            kv_cache_dtype = checkpoint_dtype if config.auto_kv_cache_dtype else kv_cache_dtype
    else:
        requested = None if config.auto_dtype else dtype
        linear = _cpu_precision(requested, checkpoint_dtype, config.quantization, is_gguf)
        if dtype == torch.bfloat16:
            dtype = torch.float32
            kv_cache_dtype = torch.float32 if config.auto_kv_cache_dtype else kv_cache_dtype
        if config.auto_kv_cache_dtype and not linear.exact:
            kv_cache_dtype = torch.bfloat16
    if config.auto_lora_dtype:
        lora_dtype = torch.float32 if linear.exact else torch.bfloat16
    else:
        lora_dtype = config.lora_dtype
    # "auto" keeps the recurrent matrices in float32 (llama.cpp's choice; vLLM's "auto" follows the
    # model's dtype): they accumulate over the whole context. The convolutions' tails are inputs,
    # lossless in the activations' dtype.
    state_dtype = None if config.auto_mamba_cache_dtype else config.mamba_cache_dtype
    ssm_state_dtype = config.mamba_ssm_cache_dtype if not config.auto_mamba_ssm_cache_dtype else state_dtype or torch.float32
    return ResolvedPrecision(linear, dtype, kv_cache_dtype, lora_dtype, ssm_state_dtype, state_dtype or dtype)


def draft_linear_precision(device: torch.device, checkpoint_dtype: torch.dtype, is_gguf: bool) -> LinearPrecision:
    """A speculative draft model's linear layers: its own checkpoint's "auto" choice on a CPU
    (what makes it cheap), whatever the target asked for."""
    if device.type != "cpu":
        return EXACT_LINEAR
    return _cpu_precision(None, checkpoint_dtype, None, is_gguf)


def _cpu_precision(
    requested: Optional[torch.dtype], checkpoint_dtype: torch.dtype, quantization: Optional[str], is_gguf: bool
) -> LinearPrecision:
    wanted = requested if requested is not None else checkpoint_dtype
    fallback: LinearKind = "float32"
    if wanted == torch.bfloat16:
        if ops.bf16_matmul_available():
            fallback = "bfloat16"
        elif requested is not None:
            logger.warning("this CPU has no AVX512_BF16 dot products: linear layers run in float32")
    use_blocks = is_gguf and (quantization == "gguf" or (quantization is None and requested is None))
    kind: LinearKind = fallback
    if use_blocks:
        if ops.int8_matmul_available():
            kind = "int8"
        elif quantization == "gguf":
            logger.warning("this CPU has no int8 dot products (AVX2 or AVX512-BW): GGUF blocks are expanded to float32")
    return LinearPrecision(kind=kind, fallback=fallback)
