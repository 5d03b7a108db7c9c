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
from typing import Optional

import torch

from pagellm.config import EngineConfig, LinearKind, LinearPrecision
from pagellm.kernels import ops

logger = logging.getLogger(__name__)


def resolve_linear_precision(config: EngineConfig, checkpoint_dtype: torch.dtype, is_gguf: bool) -> LinearPrecision:
    """The linear layers' arithmetic for this model on ``config.device``, recorded in ``config``
    (which also settles the tensors' and an "auto" KV cache's dtype); a config that already holds
    one keeps it. ``checkpoint_dtype`` is what the checkpoint names. ValueError for
    ``quantization="gguf"`` on a model that is not GGUF."""
    if config.linear_precision is not None:
        return config.linear_precision
    quantization = config.quantization
    if quantization == "gguf" and not is_gguf:
        raise ValueError("quantization='gguf' needs a GGUF model file")
    precision = LinearPrecision()
    if config.device.type == "cpu":
        requested = None if config.auto_dtype else config.dtype
        precision = _cpu_precision(requested, checkpoint_dtype, quantization, is_gguf)
    config.apply_linear_precision(precision)
    return precision


def draft_linear_precision(config: EngineConfig, checkpoint_dtype: torch.dtype, is_gguf: bool) -> LinearPrecision:
    """A speculative draft model's linear layers: its own checkpoint's "auto" choice on a CPU
    (what makes it cheap), whatever the target asked for; ``config`` is left as it is."""
    if config.device.type != "cpu":
        return LinearPrecision()
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
