"""The pre-PagedAttention KV layout, kept so benchmarks can measure what paging buys.

Systems before vLLM (FasterTransformer, Orca) gave every request one contiguous slab of KV memory
sized for the longest sequence it could reach, reserved at admission and released at the end.
Here the slab is a run of consecutive block ids, so the same model runner and attention kernels
serve both layouts: a request's block table simply counts up from its first block.

The reservation covers either the request's own limit (prompt + max_tokens, capped at
max_model_len) or max_model_len for everyone, as a server that cannot trust ``max_tokens`` would
do. A run is found first-fit over block ids; when none is long enough the request waits.
Running requests never grow, so this manager never causes a preemption. Free runs are coalesced
on release, yet holes between live runs (external fragmentation) can still refuse a request
that would fit in the total free space; that is part of what is being measured.

Like the systems it stands for, it keeps every layer's whole context: a sliding-window model is
served with all its layers in one full-attention group (``supports_sliding_window`` is False, so
the engine lays the cache out that way; the attention backends still apply the windows).
"""
from __future__ import annotations

import bisect
from typing import Optional

from pagellm.core.kv_cache_base import KVCacheBlocks, KVCacheManagerBase, register_kv_cache_manager
from pagellm.core.kv_cache_groups import KVCacheLayout
from pagellm.request import Request

RESERVE_MAX_TOKENS = "max_tokens"
RESERVE_MAX_MODEL_LEN = "max_model_len"
RESERVE_MODES = (RESERVE_MAX_TOKENS, RESERVE_MAX_MODEL_LEN)


@register_kv_cache_manager("contiguous")
class ContiguousKVCacheManager(KVCacheManagerBase):
    """One fixed run of consecutive blocks per request; no prefix sharing."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool = False,
        reserve: str = RESERVE_MAX_TOKENS,
        kv_cache_layout: Optional[KVCacheLayout] = None,
    ) -> None:
        if kv_cache_layout is not None and (kv_cache_layout.num_groups > 1 or kv_cache_layout.has_sliding_groups):
            raise ValueError(
                "the contiguous KV cache keeps every layer's whole context in one group; "
                f"got {kv_cache_layout.describe()} (lay sliding-window models out as one full-attention group)"
            )
        # The traditional design has no prefix cache, whatever the engine's setting.
        super().__init__(num_blocks, block_size, max_model_len, enable_caching=False)
        self.reserve = reserve  # validated where it is used, so benchmarks can switch it after construction
        # Free runs as parallel sorted lists of (start, length): the starts are kept sorted so a
        # release can find its neighbours by bisection and merge with them.
        self._free_starts: list[int] = [0]
        self._free_lengths: list[int] = [num_blocks]
        self.num_refusals = 0  # admissions refused for want of a long enough run

    # ---- sizing ------------------------------------------------------------------------

    def num_reserved_tokens(self, request: Request) -> int:
        """How many tokens of KV the request's slab must hold in the worst case."""
        if self.reserve == RESERVE_MAX_MODEL_LEN:
            return self.max_model_len
        if self.reserve == RESERVE_MAX_TOKENS:
            return min(request.num_prompt_tokens + request.max_tokens, self.max_model_len)
        raise ValueError(f"reserve must be one of {RESERVE_MODES}, got {self.reserve!r}")

    def num_blocks_needed(self, request: Request) -> int:
        if request.request_id in self.req_to_blocks:
            return 0
        return -(-self.num_reserved_tokens(request) // self.block_size)

    # ---- the scheduler's interface ----------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        return KVCacheBlocks(), 0  # no prefix sharing in the traditional design

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Optional[KVCacheBlocks] = None,
        num_draft_tokens: int = 0,
    ) -> Optional[KVCacheBlocks]:
        """Reserves the request's whole run on first call; later calls only check it still fits."""
        if new_computed_blocks is not None and any(new_computed_blocks.groups):
            raise ValueError("the contiguous layout has no prefix cache, so no computed blocks can be adopted")
        blocks = self.req_to_blocks.get(request.request_id)
        if blocks is not None:
            needed = request.num_computed_tokens + num_new_tokens
            if needed > len(blocks) * self.block_size:
                # The reservation is the request's maximum length, so this is a bookkeeping bug.
                raise RuntimeError(
                    f"request {request.request_id} needs {needed} tokens but reserved only "
                    f"{len(blocks) * self.block_size}"
                )
            return KVCacheBlocks()
        num_blocks = self.num_blocks_needed(request)
        if num_blocks > self.num_blocks:
            raise ValueError(
                f"request {request.request_id} must reserve {num_blocks} blocks of {self.block_size} tokens "
                f"but the whole KV cache has {self.num_blocks}; raise the KV budget or lower max_model_len"
            )
        start = self._take_first_fit(num_blocks)
        if start is None:
            self.num_refusals += 1
            return None
        pool = self.block_pool
        new_blocks = [pool.blocks[i] for i in range(start, start + num_blocks)]
        for block in new_blocks:
            pool.free_queue.remove(block)
            block.ref_cnt = 1
            pool.dirty_block_ids.add(block.block_id)
        self.req_to_blocks[request.request_id] = new_blocks
        return KVCacheBlocks(tuple(new_blocks))

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        if not blocks:
            return
        self.block_pool.free_blocks(blocks)
        self._release_run(blocks[0].block_id, len(blocks))

    def reset_prefix_cache(self) -> bool:
        return True  # nothing is ever cached

    # ---- accounting --------------------------------------------------------------------

    @property
    def num_reserved_blocks(self) -> int:
        return self.block_pool.num_used_blocks

    def free_runs(self) -> list[tuple[int, int]]:
        """(first block id, length) of each free run, in block id order."""
        return list(zip(self._free_starts, self._free_lengths))

    def largest_free_run(self) -> int:
        return max(self._free_lengths, default=0)

    # ---- first-fit over block ids ------------------------------------------------------

    def _take_first_fit(self, num_blocks: int) -> Optional[int]:
        for idx, length in enumerate(self._free_lengths):
            if length >= num_blocks:
                start = self._free_starts[idx]
                if length == num_blocks:
                    del self._free_starts[idx]
                    del self._free_lengths[idx]
                else:
                    self._free_starts[idx] = start + num_blocks
                    self._free_lengths[idx] = length - num_blocks
                return start
        return None

    def _release_run(self, start: int, length: int) -> None:
        idx = bisect.bisect_left(self._free_starts, start)
        # Merge with the following run, then with the preceding one, when they touch.
        if idx < len(self._free_starts) and self._free_starts[idx] == start + length:
            length += self._free_lengths[idx]
            del self._free_starts[idx]
            del self._free_lengths[idx]
        if idx > 0 and self._free_starts[idx - 1] + self._free_lengths[idx - 1] == start:
            self._free_lengths[idx - 1] += length
        else:
            self._free_starts.insert(idx, start)
            self._free_lengths.insert(idx, length)

    def check_integrity(self) -> None:
        super().check_integrity()
        free_ids: set[int] = set()
        prev_end = -1
        for start, length in self.free_runs():
            if length <= 0 or start <= prev_end:
                raise RuntimeError(f"free runs overlap, touch or are empty: {self.free_runs()}")
            prev_end = start + length
            free_ids.update(range(start, start + length))
        pool_free = {b.block_id for b in self.block_pool.blocks if b.ref_cnt == 0}
        if free_ids != pool_free:
            raise RuntimeError("free runs disagree with the block pool's free blocks")
        for req_id, blocks in self.req_to_blocks.items():
            ids = [b.block_id for b in blocks]
            if ids != list(range(ids[0], ids[0] + len(ids))):
                raise RuntimeError(f"request {req_id} holds non-consecutive blocks {ids}")
