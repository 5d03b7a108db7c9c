"""Sizing and allocating the paged KV cache tensors, and faulting their memory in while idle.

Layers whose KV rows differ (Gemma 4: its full layers' heads are twice as wide as its sliding
layers') share one tensor per group position, as layers of one shape do: its per-token row is the
widest row at that position (:func:`widest_kv_rows`), and a narrower layer's keys and values fill
the first part of each token's row (padded rows). A block id is a page of one group in every
tensor, so a block costs the widest row at each position, once; the narrow sliding groups hold
only a window of blocks, so the padding they carry stays small. (The design before this gave each
position a tensor per shape, every one sized for all blocks: every block paid for both rows.)

A narrower layer is handed its cache as a view of the position's tensor,
``[2, num_blocks, block_size, kv_heads, row_width]`` with the wider token stride
(``kv_quant.narrow_kv_view``): the heads of one token are dense, the tokens ``stride(2)``
elements apart. The backends take any such view: the torch ones gather through the strides, the
C++ kernel and its cache write address a token by ``kv_cache.stride(2)``, the Triton kernels are
given the cache's strides. A view rather than a [2, blocks, block_size, row] tensor plus the
layer's (heads, head size) keeps one cache argument per layer and the backends' signatures. An
8-bit cache's rows keep their scales at the end of each head row, so they pad the same way.
vLLM's page-size unification (pages of equal bytes, a narrow group holding more tokens per block)
would save the padding too, but needs a block size per group in the KV cache manager, its prefix
hashing and every block table. A model whose layers share one shape keeps one tensor per
position and every layer the tensor itself, byte for byte as before.
"""
from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import time
from typing import Callable, Optional, Sequence

import torch

from pagellm.attention.kv_quant import bytes_per_token_head, narrow_kv_view, row_width
from pagellm.core.kv_cache_groups import KVCacheLayout

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 * 2**20


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V of one block across ``num_layers`` layers (an int8 cache's row scales included).

    A pool block is one page of a KV cache group, so a cache is sized with ``num_layers`` the
    layout's ``group_size``: all the layers for a full-attention model, fewer for a hybrid one.
    """
    return 2 * num_layers * block_size * num_kv_heads * bytes_per_token_head(head_dim, dtype)


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


def activation_reserve_bytes(
    max_num_batched_tokens: int, max_num_seqs: int, hidden_size: int, intermediate_size: int, vocab_size: int, dtype_bytes: int
) -> int:
    """A step's peak activation memory, generously: a few hidden-sized tensors and the MLP's
    intermediate per token, float32 logits and the sampler's copies per sequence, and 256 MiB for
    the CUDA context's workspaces and the decode graphs' pool."""
    per_token = (8 * hidden_size + 3 * intermediate_size) * dtype_bytes
    logits = 4 * max_num_seqs * vocab_size * 4
    return max_num_batched_tokens * per_token + logits + 256 * 2**20


def gpu_kv_cache_budget(utilization: float, reserve_bytes: int, mem_get_info: Callable[[], tuple[int, int]]) -> int:
    """Bytes for the KV cache on a GPU, vLLM's way: ``utilization`` of the device's memory, minus
    what is in use already (the weights, other processes) and the activations' ``reserve_bytes``.

    ``mem_get_info`` returns (free, total) bytes, as ``torch.cuda.mem_get_info``; call this after
    the model is loaded.
    """
    free, total = mem_get_info()
    budget = int(total * utilization) - (total - free) - reserve_bytes
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: {utilization:.0%} of {total / 2**30:.1f} GiB allowed, "
            f"{(total - free) / 2**30:.1f} GiB in use, {reserve_bytes / 2**30:.1f} GiB kept for activations; "
            "raise gpu_memory_utilization or pass kv_cache_memory_bytes"
        )
    return budget


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> list[torch.Tensor]:
    """One ``[2, num_blocks, block_size, num_kv_heads, row_width]`` tensor per layer (row_width is
    head_dim, plus two for an int8 cache's row scale: pagellm.attention.kv_quant).

    Zero-filled rather than empty: attention multiplies masked-out probabilities (exact zeros)
    with whatever sits in unused slots, and 0 * NaN from uninitialised memory would be NaN.
    """
    shape = (2, num_blocks, block_size, num_kv_heads, row_width(head_dim, dtype))
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


def allocate_grouped_kv_caches(
    layout: KVCacheLayout,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    layer_kv_heads: Optional[Sequence[tuple[int, int]]] = None,
) -> list[torch.Tensor]:
    """One KV cache per attention layer, as the model takes them: ``layout.group_size`` tensors,
    layer k of every group sharing tensor k (a block id is a page of one group, so the groups never
    collide). With one group this is ``allocate_kv_caches``: a tensor of its own per layer. A
    recurrent layer's entry is None (its state is in ``allocate_state_caches``'), as is a layer's
    without a cache; a layer reading another's KV gets that layer's cache. ``layer_kv_heads``:
    per layer (this rank's KV heads, head size) where layers differ: each position's tensor has
    the widest row there (:func:`widest_kv_rows`), a narrower layer a view of its first part."""
    state = set(layout.state_layer_ids) | set(layout.no_cache_layer_ids)
    if layer_kv_heads is None:
        tensors = allocate_kv_caches(layout.group_size, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
        return [None if layer in state else tensors[i] for layer, i in enumerate(layout.layer_tensor_ids)]
    rows = widest_kv_rows(layout, layer_kv_heads, dtype)
    tensors = [allocate_kv_caches(1, num_blocks, block_size, heads, dim, dtype, device)[0] for heads, dim in rows]
    caches: list[Optional[torch.Tensor]] = [None] * layout.num_layers
    for group in layout.groups:
        for position, layer in enumerate(group.layer_ids):
            heads, dim = int(layer_kv_heads[layer][0]), int(layer_kv_heads[layer][1])
            wide = tensors[position]
            caches[layer] = wide if (heads, dim) == rows[position] else narrow_kv_view(wide, heads, dim)
    for layer, source in layout.kv_shared_layers:
        caches[layer] = caches[source]
    return caches


def widest_kv_rows(layout: KVCacheLayout, layer_kv_heads: Sequence[tuple[int, int]], dtype: torch.dtype) -> list[tuple[int, int]]:
    """Per group position, the (KV heads, head size) of the widest token row among the layers there
    (in ``dtype``'s elements, an int8 row's scales included; the first such layer on a tie): the
    shape of the position's tensor, which the narrower layers' rows pad into."""
    rows: list[tuple[int, int]] = []
    for position in range(layout.group_size):
        shapes = [
            (int(layer_kv_heads[g.layer_ids[position]][0]), int(layer_kv_heads[g.layer_ids[position]][1]))
            for g in layout.groups
            if position < len(g.layer_ids)
        ]
        if not shapes:
            raise ValueError(f"no group has a layer at KV cache position {position} of {layout.group_size}")
        rows.append(max(shapes, key=lambda shape: shape[0] * row_width(shape[1], dtype)))
    return rows


def grouped_bytes_per_block(layout: KVCacheLayout, layer_kv_heads: Sequence[tuple[int, int]], block_size: int, dtype: torch.dtype) -> int:
    """One pool block: the widest row at each group position (:func:`widest_kv_rows`)."""
    return sum(bytes_per_block(1, block_size, heads, dim, dtype) for heads, dim in widest_kv_rows(layout, layer_kv_heads, dtype))


def distinct_cache_tensors(caches: Sequence[object]) -> list[torch.Tensor]:
    """Each cache tensor once, in order of first use: layers of different groups and layers reading
    another's KV share a tensor, and a narrow layer's view (padded rows) starts where its position's
    tensor does, so a tensor is known by its first byte and kept as its widest view (the whole
    contiguous tensor). Entries that are not tensors (a recurrent layer's state tuple, None) are skipped."""
    by_start: dict[int, torch.Tensor] = {}
    for cache in caches:
        if isinstance(cache, torch.Tensor):
            kept = by_start.get(cache.data_ptr())
            if kept is None or cache.nbytes > kept.nbytes:
                by_start[cache.data_ptr()] = cache
    return list(by_start.values())


def allocate_state_caches(
    num_layers: int, num_slots: int, slot_shapes: list[tuple[tuple[int, ...], torch.dtype]], device: torch.device
) -> list[tuple[torch.Tensor, ...]]:
    """Each recurrent layer's state tensors, ``[num_slots, *shape]`` for each (shape, dtype) of
    ``slot_shapes`` (one rank's part). Zero-filled, as the KV cache is."""
    return [tuple(torch.zeros((num_slots, *shape), dtype=dtype, device=device) for shape, dtype in slot_shapes) for _ in range(num_layers)]


# Linux 5.14+: fault a range in writable, as a write to each page would, without touching the data.
MADV_POPULATE_WRITE = 23
MADV_HUGEPAGE = 14
MADV_NOHUGEPAGE = 15
MADV_COLLAPSE = 25  # Linux 6.1+: gather a populated range into 2 MiB pages, contents kept
PREFAULT_CHUNK_BYTES = 4 * 2**20
# A slice that faults in slower than this (seconds per MiB) means each 2 MiB page is costly to get
# (compaction, or a VM host backing it): the rest of the cache then faults in on small pages.
# The threshold sits between the two cases' costs (docs/benchmarks.md, "The KV cache's memory").
SLOW_FAULT_S_PER_MIB = 2e-3


class KVCachePrefaulter:
    """Faults the CPU KV cache's memory in, one slice per call, for an engine with nothing to do.

    The cache is mapped lazily (see ``zeros_on_huge_pages``), so the first write to each page
    faults inside a step, and in a VM whose host backs guest memory lazily that fault is slow.
    Doing it all at start-up would delay readiness by as much, so the server's engine thread calls
    ``prefault_next`` while no request is in flight: one ``PREFAULT_CHUNK_BYTES`` slice at a time,
    so a request that arrives meanwhile waits at most one slice. ``madvise`` runs through ctypes,
    which releases the GIL. A slice that shows 2 MiB pages cost compaction to fault in puts the rest
    of the cache on 4 KiB pages. Measurements: docs/benchmarks.md, "The KV cache's memory".
    """

    def __init__(self, kv_caches: list[torch.Tensor], chunk_bytes: int = PREFAULT_CHUNK_BYTES) -> None:
        self.chunk_bytes = chunk_bytes
        page = mmap.PAGESIZE
        # Layers of different KV cache groups share tensors (a narrow layer's a view): each is faulted in once.
        unique = distinct_cache_tensors(kv_caches)
        # (start, end) byte ranges, widened to whole pages: populating is content-preserving, so the
        # part of a neighbouring allocation on a shared first or last page is unharmed.
        self._ranges = [
            (c.data_ptr() // page * page, -(-(c.data_ptr() + c.nbytes) // page) * page)
            for c in unique
            if c.device.type == "cpu" and c.nbytes > 0
        ]
        self._kv_caches = kv_caches  # the mappings must outlive the ranges above
        self.total_bytes = sum(end - start for start, end in self._ranges)
        self.done_bytes = 0
        self._elapsed_s = 0.0
        self.huge_pages = True  # until a slice shows that 2 MiB pages are costly to fault in
        self._collapse: list[tuple[int, int]] = []  # ranges faulted in on small pages, to gather
        self.collapsed_bytes = 0
        self._collapse_s = 0.0
        self._madvise = _libc_madvise() if self._ranges else None
        if self._madvise is None:
            self._ranges = []

    @property
    def pending(self) -> bool:
        return bool(self._ranges or self._collapse)

    def prefault_next(self) -> bool:
        """Faults in the next slice (or, once all is faulted in, gathers the next slice that went on
        small pages into 2 MiB ones); returns whether any work remains."""
        if not self._ranges:
            return self._collapse_next()
        done = self._advise_slice(self._ranges, MADV_POPULATE_WRITE)
        if done is None:
            # e.g. EINVAL before Linux 5.14: pages are then faulted in when first written, as before
            self._ranges = []
            return False
        length, elapsed = done
        self._elapsed_s += elapsed
        self.done_bytes += length
        if self.huge_pages and elapsed > SLOW_FAULT_S_PER_MIB * length / 2**20:
            self._give_up_huge_pages(elapsed * 1e3 / (length / 2**20))
        if not self._ranges:
            logger.info("KV cache memory faulted in while idle: %.1f MiB in %.2f s", self.done_bytes / 2**20, self._elapsed_s)
            # Every page is in: advised huge again (MADV_COLLAPSE takes only eligible regions), no
            # fault is left to take the advice.
            if not self._advise_ranges(self._collapse, MADV_HUGEPAGE):
                self._collapse = []
        return self.pending

    def _collapse_next(self) -> bool:
        if not self._collapse:
            return False
        done = self._advise_slice(self._collapse, MADV_COLLAPSE)
        if done is None:
            # e.g. EINVAL before Linux 6.1, or no memory to compact: the rest stays on small pages
            self._collapse = []
            return False
        self.collapsed_bytes += done[0]
        self._collapse_s += done[1]
        if not self._collapse:
            logger.info("KV cache back on 2 MiB pages while idle: %.1f MiB in %.2f s", self.collapsed_bytes / 2**20, self._collapse_s)
        return bool(self._collapse)

    def _advise_slice(self, ranges: list[tuple[int, int]], advice: int) -> Optional[tuple[int, float]]:
        """madvise on the first chunk_bytes of ranges[0], taken off the list: (bytes, seconds), or
        None (the list untouched) if the kernel refused."""
        start, end = ranges[0]
        length = min(self.chunk_bytes, end - start)
        t0 = time.perf_counter()
        if self._madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), advice) != 0:
            logger.debug("madvise(%d) failed: %s", advice, os.strerror(ctypes.get_errno()))
            return None
        elapsed = time.perf_counter() - t0
        if start + length < end:
            ranges[0] = (start + length, end)
        else:
            ranges.pop(0)
        return length, elapsed

    def _advise_ranges(self, ranges: list[tuple[int, int]], advice: int) -> bool:
        for start, end in ranges:
            if self._madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), advice) != 0:
                logger.debug("madvise(%d) failed: %s", advice, os.strerror(ctypes.get_errno()))
                return False
        return True

    def _give_up_huge_pages(self, ms_per_mib: float) -> None:
        """Faults the rest in on 4 KiB pages (fast), then, in later idle time, gathers it back into
        2 MiB pages (MADV_COLLAPSE, slice by slice): decode attention reads scattered blocks with
        fewer TLB misses on huge pages, but faulting them in costs seconds inside the first steps."""
        self.huge_pages = False
        if not self._advise_ranges(self._ranges, MADV_NOHUGEPAGE):
            return
        self._collapse = list(self._ranges)
        logger.info(
            "KV cache: 2 MiB pages fault in at %.1f ms a MiB here; the remaining %.1f MiB faulted in on 4 KiB pages, "
            "gathered into 2 MiB pages while idle",
            ms_per_mib,
            sum(end - start for start, end in self._ranges) / 2**20,
        )


def _libc_madvise() -> Optional[Callable[..., int]]:
    if not hasattr(mmap, "MADV_HUGEPAGE"):  # not Linux
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise
