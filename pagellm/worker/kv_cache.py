"""Sizing and allocating the paged KV cache tensors."""
from __future__ import annotations

from typing import Optional

import torch


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one block, across all layers."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def determine_num_blocks(
    num_kv_blocks: Optional[int],
    kv_cache_memory_bytes: Optional[int],
    default_memory_bytes: int,
    block_bytes: int,
    block_size: int,
    max_model_len: int,
) -> int:
    """An explicit block count wins; otherwise as many blocks as the memory budget holds."""
    if num_kv_blocks is not None:
        return num_kv_blocks
    budget = kv_cache_memory_bytes if kv_cache_memory_bytes is not None else default_memory_bytes
    num_blocks = budget // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"a KV cache budget of {budget} bytes holds no block of {block_size} tokens ({block_bytes} bytes); "
            "raise kv_cache_memory_bytes"
        )
    return int(num_blocks)


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer.

    Zero-filled rather than empty: attention multiplies masked-out probabilities (exact zeros)
    with whatever sits in unused slots, and 0 * NaN from uninitialised memory would be NaN.
    """
    return [
        torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
        for _ in range(num_layers)
    ]
