"""One KV cache group's block tables: full attention keeps every block, a sliding window only
the blocks its next queries can still reach (vLLM's FullAttentionManager and SlidingWindowManager).

A sliding group with window W frees, as a request grows, the blocks that lie wholly before
``first position computed this step - W + 1``: no query of this step or a later one reads them.
Their table entries then point to the pool's null block; with prefix caching the freed blocks stay
indexed, evictable like any freed block. Nulled entries always form a prefix of a table.
"""
from __future__ import annotations

from typing import Optional, Sequence

from pagellm.core.block_hash import BlockHash
from pagellm.core.block_pool import BlockPool, KVCacheBlock
from pagellm.core.kv_cache_groups import cdiv
from pagellm.request import Request


class SingleTypeKVCacheManager:
    def __init__(self, block_pool: BlockPool, block_size: int, group_id: int, sliding_window: Optional[int] = None) -> None:
        if sliding_window is not None and block_pool.null_block is None:
            raise ValueError("a sliding-window group needs a pool with a null block")
        self.block_pool = block_pool
        self.block_size = block_size
        self.group_id = group_id
        self.sliding_window = sliding_window
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's leading blocks have been offered to the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # How many of a request's leading entries are the null block (a sliding group's only).
        self.num_null_entries: dict[str, int] = {}

    def _null_block(self) -> KVCacheBlock:
        null = self.block_pool.null_block
        if null is None:  # only sliding groups ask, and __init__ refused them a pool without one
            raise RuntimeError("the block pool has no null block")
        return null

    # ---- prefix-cache lookup ------------------------------------------------------------

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int) -> list[KVCacheBlock]:
        """The longest hit of at most ``max_num_blocks`` blocks this group can serve.

        Full attention needs every block of the hit. A window needs only the blocks that the first
        query after the hit reaches, the last ``cdiv(W - 1, block_size)`` ones, so the scan runs
        right to left for such a run; the entries before it are the null block.
        """
        pool = self.block_pool
        if self.sliding_window is None:
            hits: list[KVCacheBlock] = []
            for block_hash in block_hashes[:max_num_blocks]:
                block = pool.get_cached_block(block_hash, self.group_id)
                if block is None:
                    break
                hits.append(block)
            return hits
        null = self._null_block()
        num_needed = cdiv(self.sliding_window - 1, self.block_size)
        if num_needed == 0:  # a one-token window reads only the query's own key
            return [null] * max_num_blocks
        computed: list[KVCacheBlock] = [null] * max_num_blocks
        run = 0
        for i in range(max_num_blocks - 1, -1, -1):
            block = pool.get_cached_block(block_hashes[i], self.group_id)
            if block is None:
                run = 0
                continue
            computed[i] = block
            run += 1
            if run >= num_needed:
                return computed[: i + run]
        # No run long enough: the leading blocks still serve a hit shorter than the window.
        return computed[:run]

    # ---- sizing a step ------------------------------------------------------------------

    def _skip_range(self, request_id: str, num_computed_tokens: int) -> tuple[int, int]:
        """Table indices [start, end) of held blocks wholly before the window of a query at
        ``num_computed_tokens`` (empty for full attention)."""
        blocks = self.req_to_blocks.get(request_id)
        if self.sliding_window is None or not blocks:
            return 0, 0
        num_skipped_tokens = max(0, num_computed_tokens - self.sliding_window + 1)
        # Nulled entries form a prefix: everything before its end is skipped already.
        start = self.num_null_entries.get(request_id, 0)
        return start, max(start, min(len(blocks), num_skipped_tokens // self.block_size))

    def blocks_to_skip(self, request_id: str, num_computed_tokens: int) -> list[KVCacheBlock]:
        """Held blocks no query from ``num_computed_tokens`` on reads, last first."""
        start, end = self._skip_range(request_id, num_computed_tokens)
        return self.req_to_blocks[request_id][start:end][::-1] if end > start else []

    def num_releasable_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        """Blocks that skipping would return to the free queue (held by this request alone)."""
        return sum(1 for b in self.blocks_to_skip(request_id, num_computed_tokens) if b.ref_cnt == 1)

    def num_new_blocks(self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]) -> int:
        """Blocks to take from the free queue for ``num_tokens`` in all, adopted hits included
        (a hit that sits free counts: adopting it takes it out of the queue)."""
        num_entries = len(self.req_to_blocks.get(request_id, ())) + len(new_computed_blocks)
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not self.block_pool.is_null(b))
        return max(0, cdiv(num_tokens, self.block_size) - num_entries) + num_revived

    # ---- changing the tables ------------------------------------------------------------

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        start, end = self._skip_range(request_id, num_computed_tokens)
        if end <= start:
            return
        blocks = self.req_to_blocks[request_id]
        skipped = blocks[start:end]
        blocks[start:end] = [self._null_block()] * (end - start)
        self.num_null_entries[request_id] = end
        self.block_pool.free_blocks(reversed(skipped))  # last first, as a freed table goes

    def save_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]) -> None:
        """Adopts prefix-cache hits (at admission, before the request holds anything)."""
        self.block_pool.touch(new_computed_blocks)
        blocks = self.req_to_blocks.setdefault(request_id, [])
        if not blocks and self.sliding_window is not None:
            num_null = 0
            while num_null < len(new_computed_blocks) and self.block_pool.is_null(new_computed_blocks[num_null]):
                num_null += 1
            self.num_null_entries[request_id] = num_null
        blocks.extend(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.setdefault(request_id, [])
        new_blocks = self.block_pool.get_new_blocks(max(0, cdiv(num_tokens, self.block_size) - len(blocks)))
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_full_blocks: int) -> None:
        """Indexes the request's blocks up to ``num_full_blocks`` (those this step fills included)."""
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full_blocks > start:
            blocks = self.req_to_blocks[request.request_id]
            self.block_pool.cache_full_blocks(blocks, request.block_hashes, start, num_full_blocks, self.group_id)
            self.num_cached_blocks[request.request_id] = num_full_blocks

    def free(self, request_id: str) -> None:
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        self.num_null_entries.pop(request_id, None)
        # Tail first: the end of a chain is the least likely part to be shared again.
        self.block_pool.free_blocks(reversed(blocks))

    # ---- reading ------------------------------------------------------------------------

    def num_held_blocks(self, request_id: str) -> int:
        return len(self.req_to_blocks.get(request_id, ())) - self.num_null_entries.get(request_id, 0)

    def check_tables(self) -> None:
        """Raises if a table breaks this group's rules (nulls only as a prefix, only in windows)."""
        for req_id, blocks in self.req_to_blocks.items():
            num_null = 0
            while num_null < len(blocks) and self.block_pool.is_null(blocks[num_null]):
                num_null += 1
            if any(self.block_pool.is_null(b) for b in blocks[num_null:]):
                raise RuntimeError(f"group {self.group_id}, request {req_id}: a null entry after a held block")
            if num_null and self.sliding_window is None:
                raise RuntimeError(f"group {self.group_id} (full attention), request {req_id}: null entries")
            counted = self.num_null_entries.get(req_id, 0)
            if num_null != counted:
                raise RuntimeError(f"group {self.group_id}, request {req_id}: {num_null} null entries, {counted} counted")
