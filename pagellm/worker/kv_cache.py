"""Sizing and allocating the paged KV cache tensors."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
from typing import Optional

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 * 2**20
_MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


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
    """A zero CPU tensor whose memory the kernel is asked to back with 2 MiB pages.

    Decode attention reads every sequence's blocks from scattered places in a cache of gigabytes:
    with 4 KiB pages nearly every block is a TLB miss and a page walk (a costly one in a virtual
    machine). Linux gives huge pages to regions marked MADV_HUGEPAGE when transparent huge pages
    are set to "madvise" (a common default); the region must be 2 MiB-aligned and marked before
    it is first touched, so the zeros are written after the advice. Elsewhere this is plain zeros.
    """
    numel = 1
    for dim in shape:
        numel *= dim
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not sys.platform.startswith("linux") or nbytes < HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE_BYTES, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    _advise_huge_pages(raw.data_ptr() + start, nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    # The view keeps `raw` alive; element alignment holds since start is a multiple of 2 MiB.
    return raw[start : start + nbytes].view(dtype).view(shape).zero_()


def _advise_huge_pages(address: int, length: int) -> None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), _MADV_HUGEPAGE) != 0:
            logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
    except OSError as exc:  # no libc to call: small pages then
        logger.debug("no madvise: %s", exc)
