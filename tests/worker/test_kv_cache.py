"""Sizing and allocating the paged KV cache."""
from __future__ import annotations

import gc
import mmap

import pytest
import torch

from pagellm.worker.kv_cache import (
    HUGE_PAGE_BYTES,
    allocate_kv_caches,
    bytes_per_block,
    determine_num_blocks,
    zeros_on_huge_pages,
)


def test_block_bytes_and_count() -> None:
    block = bytes_per_block(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.float32)
    assert block == 2 * 30 * 16 * 3 * 64 * 4
    assert determine_num_blocks(None, 10 * block + 1, 0, block, 16, 2048) == 10
    assert determine_num_blocks(7, None, 10**12, block, 16, 2048) == 7  # an explicit count wins
    with pytest.raises(ValueError, match="holds no block"):
        determine_num_blocks(None, block - 1, 0, block, 16, 2048)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_caches_are_zero_and_shaped_per_layer(dtype: torch.dtype) -> None:
    caches = allocate_kv_caches(3, 100, 16, 3, 64, dtype, torch.device("cpu"))
    assert len(caches) == 3 and len({c.data_ptr() for c in caches}) == 3
    for cache in caches:
        assert cache.shape == (2, 100, 16, 3, 64) and cache.dtype == dtype and cache.is_contiguous()
        assert not cache.any()


def test_large_cpu_caches_start_on_a_huge_page_boundary() -> None:
    shape = (2, 300, 16, 3, 64)  # 7 MiB of float32
    cache = zeros_on_huge_pages(shape, torch.float32)
    assert cache.shape == shape and cache.is_contiguous() and not cache.any()
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        assert cache.data_ptr() % HUGE_PAGE_BYTES == 0
    gc.collect()  # the tensor alone keeps its memory mapped
    cache.fill_(1.0)
    assert float(cache.sum()) == cache.numel()
    small = zeros_on_huge_pages((2, 3), torch.float16)
    assert small.shape == (2, 3) and not small.any()
