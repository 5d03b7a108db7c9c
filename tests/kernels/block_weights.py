"""Weights that are almost, but not exactly, GGUF blocks: a packer must refuse every one."""
from __future__ import annotations

import torch

from pagellm.kernels.tuning import block_quantized


def not_quite_blocks() -> list[torch.Tensor]:
    """One value off by one ulp, a NaN, inputs not a multiple of 32, and plain random floats."""
    gen = torch.Generator().manual_seed(0)
    almost = block_quantized(64, 128, 4, gen)
    almost[17, 40] = torch.nextafter(almost[17, 40], torch.tensor(1.0))
    nan = block_quantized(64, 128, 8, gen)
    nan[3, 3] = float("nan")
    ragged = block_quantized(64, 128, 4, gen)[:, :100].contiguous()
    return [almost, nan, ragged, torch.randn(64, 128)]
