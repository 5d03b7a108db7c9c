"""Sizing and allocating the paged KV cache."""
from __future__ import annotations

import gc
import mmap

import pytest
import torch

from pagellm.worker import kv_cache
from pagellm.worker.kv_cache import (
    HUGE_PAGE_BYTES,
    KVCachePrefaulter,
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


def test_eight_bit_caches_hold_twice_the_tokens_of_bfloat16() -> None:
    # SmolLM2-135M in the default 2 GiB: an int8 row carries its float16 scale (66 bytes a head).
    shape = dict(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64)
    tokens = {
        name: determine_num_blocks(None, None, 2 << 30, bytes_per_block(**shape, dtype=dtype), 16, 8192) * 16
        for name, dtype in [("bfloat16", torch.bfloat16), ("fp8", torch.float8_e4m3fn), ("int8", torch.int8)]
    }
    assert bytes_per_block(**shape, dtype=torch.int8) == 2 * 30 * 16 * 3 * 66
    assert tokens == {"bfloat16": 93200, "fp8": 186400, "int8": 180752}


@pytest.mark.parametrize(("dtype", "width"), [(torch.int8, 66), (torch.float8_e5m2, 64)])
def test_eight_bit_caches_are_shaped_by_their_rows(dtype: torch.dtype, width: int) -> None:
    caches = allocate_kv_caches(2, 10, 16, 3, 64, dtype, torch.device("cpu"))
    assert all(c.shape == (2, 10, 16, 3, width) and c.dtype == dtype and not c.view(torch.uint8).any() for c in caches)


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


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def test_prefaulter_faults_the_cache_in_by_slices_and_keeps_its_contents(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_cache, "SLOW_FAULT_S_PER_MIB", float("inf"))  # huge pages kept, however slow
    caches = allocate_kv_caches(2, 1024, 16, 2, 64, torch.float32, torch.device("cpu"))  # 2 x 16 MiB
    caches[0][0, 0, 0, 0, :4] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    prefaulter = KVCachePrefaulter(caches, chunk_bytes=5 * 2**20)
    if not prefaulter.pending:
        pytest.skip("MADV_POPULATE_WRITE is not available here (Linux 5.14+)")
    assert prefaulter.total_bytes == sum(c.nbytes for c in caches) == 32 * 2**20
    before = _resident_bytes()
    num_calls = 0
    while prefaulter.prefault_next():
        num_calls += 1
    num_calls += 1
    assert num_calls == 2 * 4  # 16 MiB per layer in slices of 5 MiB: 5 + 5 + 5 + 1
    assert prefaulter.done_bytes == prefaulter.total_bytes and not prefaulter.pending
    assert not prefaulter.prefault_next()
    # The pages are now resident (30 of the 32 MiB allowing for pages touched before)...
    assert _resident_bytes() - before >= 30 * 2**20
    # ...and what was written before is still there, the rest still zero.
    assert caches[0][0, 0, 0, 0, :4].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert float(caches[0].abs().sum()) == 10.0 and not caches[1].any()


def test_prefaulter_moves_the_rest_to_small_pages_when_huge_ones_fault_in_slowly(monkeypatch: pytest.MonkeyPatch) -> None:
    caches = allocate_kv_caches(2, 1024, 16, 2, 64, torch.float32, torch.device("cpu"))  # 2 x 16 MiB
    caches[1][0, 0, 0, 0, 0] = 5.0
    prefaulter = KVCachePrefaulter(caches, chunk_bytes=4 * 2**20)
    if not prefaulter.pending:
        pytest.skip("MADV_POPULATE_WRITE is not available here (Linux 5.14+)")
    calls: list[tuple[int, int, int]] = []
    real = prefaulter._madvise

    def recording(start, length, advice) -> int:
        calls.append((start.value, length.value, advice))
        return real(start, length, advice)

    prefaulter._madvise = recording
    monkeypatch.setattr(kv_cache, "SLOW_FAULT_S_PER_MIB", 0.0)  # every slice counts as slow
    assert prefaulter.prefault_next() and not prefaulter.huge_pages
    ranges = [(c.data_ptr(), c.data_ptr() + c.nbytes) for c in caches]
    # one slice populated, then what remains of layer 0 and all of layer 1 advised off huge pages
    assert calls == [
        (ranges[0][0], 4 * 2**20, kv_cache.MADV_POPULATE_WRITE),
        (ranges[0][0] + 4 * 2**20, 12 * 2**20, kv_cache.MADV_NOHUGEPAGE),
        (ranges[1][0], 16 * 2**20, kv_cache.MADV_NOHUGEPAGE),
    ]
    while prefaulter.prefault_next():
        pass
    assert prefaulter.done_bytes == prefaulter.total_bytes and not prefaulter.pending
    assert sum(1 for *_, advice in calls if advice == kv_cache.MADV_NOHUGEPAGE) == 2  # decided once
    # Once all is faulted in, the small-page ranges are advised huge again and gathered slice by
    # slice (unless this kernel has no MADV_COLLAPSE: then the first attempt ends it).
    after = calls[calls.index((ranges[1][0], 16 * 2**20, kv_cache.MADV_NOHUGEPAGE)) + 1 :]
    populate = [c for c in after if c[2] == kv_cache.MADV_POPULATE_WRITE]
    assert len(populate) == 3 + 4  # layer 0's last 12 MiB, then layer 1, in 4 MiB slices
    assert [c for c in after if c[2] == kv_cache.MADV_HUGEPAGE] == [
        (ranges[0][0] + 4 * 2**20, 12 * 2**20, kv_cache.MADV_HUGEPAGE),
        (ranges[1][0], 16 * 2**20, kv_cache.MADV_HUGEPAGE),
    ]
    collapse = [c for c in after if c[2] == kv_cache.MADV_COLLAPSE]
    if prefaulter.collapsed_bytes:
        assert prefaulter.collapsed_bytes == 28 * 2**20 and len(collapse) == 7
    else:
        assert len(collapse) == 1
    assert float(caches[1].sum()) == 5.0 and not caches[0].any()


def test_prefaulter_has_nothing_to_do_for_non_cpu_caches() -> None:
    prefaulter = KVCachePrefaulter([torch.empty((2, 8, 16, 2, 64), device="meta")])
    assert not prefaulter.pending and prefaulter.total_bytes == 0
    assert not prefaulter.prefault_next()
