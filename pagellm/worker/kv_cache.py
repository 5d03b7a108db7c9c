"""Sizing and allocating the paged KV cache tensors."""
from __future__ import annotations

import logging
import math
import mmap
from typing import Optional

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 * 2**20


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
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    if device.type == "cpu":
        return [zeros_on_huge_pages(shape, dtype) for _ in range(num_layers)]
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor in fresh anonymous memory that the kernel is asked to back with 2 MiB pages.

    Decode attention reads every sequence's blocks from scattered places in a cache of gigabytes:
    with 4 KiB pages nearly every block is a TLB miss and a page walk (a costly one in a virtual
    machine). Linux gives huge pages to regions marked MADV_HUGEPAGE when transparent huge pages
    are set to "madvise" (a common default). The mapping is zero by definition and its pages are
    only faulted in (and zeroed by the kernel) when first written, as with torch.zeros, so start-up
    does not pay for gigabytes of zeroing. Elsewhere, or for small tensors, this is torch.zeros.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    # One huge page extra, so that a 2 MiB-aligned stretch of nbytes fits whatever the start.
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(advice)
    except OSError as exc:  # e.g. transparent huge pages compiled out: small pages then
        logger.debug("madvise(MADV_HUGEPAGE) failed: %s", exc)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds a reference: the mapping lives as long
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    return raw[start : start + nbytes].view(dtype).view(shape)
