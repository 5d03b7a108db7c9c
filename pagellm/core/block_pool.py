"""The pool of physical KV blocks: free list, reference counts and the prefix-cache index.

Every block is in exactly one of two states:
  * in use: ``ref_cnt > 0``, owned by one or more requests (several when they share a prefix);
  * free:   ``ref_cnt == 0``, linked into the free queue. A free block may still carry a hash,
            so a later request with the same prefix can revive it instead of recomputing.

The free queue is ordered by eviction priority: allocation takes from the head, freeing appends
to the tail. A request frees its blocks tail-first, so within a chain the last blocks (least
likely to be shared) are evicted before the first ones, and across requests the least recently
freed are evicted first (LRU). All operations are O(1) per block; nothing scans the pool.

A pool serving sliding-window groups reserves block 0 as the null block: the table entries a
window has left behind point to it. It is never free, never owned and never cached.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

from pagellm.core.block_hash import BlockHash, group_block_hash


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: Optional[BlockHash] = None
    # Links of the doubly linked free queue; None when not in it.
    prev_free: Optional["KVCacheBlock"] = field(default=None, repr=False)
    next_free: Optional["KVCacheBlock"] = field(default=None, repr=False)


class FreeKVCacheBlockQueue:
    """A doubly linked list of free blocks with O(1) popleft, append and removal from the middle.

    Python's deque cannot remove from the middle in O(1), and reviving a cached free block means
    exactly that.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)  # sentinels, never handed out
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free, block.prev_free = block, prev
            prev = block
        prev.next_free, self._tail.prev_free = self._tail, prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Free block ids in eviction order (for tests and integrity checks; O(n))."""
        ids, block = [], self._head.next_free
        while block is not None and block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool, reserve_null_block: bool = False) -> None:
        if num_blocks < 1 + reserve_null_block:
            raise ValueError(f"the KV cache needs at least {1 + reserve_null_block} blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.null_block: Optional[KVCacheBlock] = self.blocks[0] if reserve_null_block else None
        self.num_reserved_blocks = int(reserve_null_block)
        self.free_queue = FreeKVCacheBlockQueue(self.blocks[self.num_reserved_blocks :])
        self.cached_blocks: dict[BlockHash, KVCacheBlock] = {}
        # Kept as a count (checked by check_integrity) so metrics read it each step without a scan.
        self.num_cached_free_blocks = 0
        # Ids of blocks whose ref_cnt or hash changed since the last take_dirty_block_ids(), so a
        # reader (the dashboard's snapshotter) follows the pool without scanning it. A set of ids,
        # so it never outgrows the pool, read or not.
        self.dirty_block_ids: set[int] = set()
        # With an offloading tier (pagellm.core.kv_tier): (block id, key) of each cached block handed
        # out again, so that its page is saved before it is overwritten. None: nobody listens.
        self.evictions: Optional[list[tuple[int, BlockHash]]] = None

    def take_dirty_block_ids(self) -> set[int]:
        dirty, self.dirty_block_ids = self.dirty_block_ids, set()
        return dirty

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now, cached-but-unused ones included."""
        return self.free_queue.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can own: all but the null block."""
        return self.num_blocks - self.num_reserved_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.free_queue.num_free_blocks

    def usage(self) -> float:
        return self.num_used_blocks / self.num_usable_blocks

    def is_null(self, block: KVCacheBlock) -> bool:
        return block is self.null_block

    def get_cached_block(self, block_hash: BlockHash, group_id: int = 0) -> Optional[KVCacheBlock]:
        return self.cached_blocks.get(group_block_hash(block_hash, group_id)) if self.enable_caching else None

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks > self.free_queue.num_free_blocks:
            raise ValueError(f"cannot get {num_blocks} free blocks, only {self.free_queue.num_free_blocks} left")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            new_blocks.append(block)
        self.dirty_block_ids.update(b.block_id for b in new_blocks)
        return new_blocks

    def _is_indexed(self, block: KVCacheBlock) -> bool:
        return block.block_hash is not None and self.cached_blocks.get(block.block_hash) is block

    def _evict(self, block: KVCacheBlock) -> None:
        """Drops a free block from the prefix-cache index as it is handed out again."""
        if self._is_indexed(block):
            del self.cached_blocks[block.block_hash]
            self.num_cached_free_blocks -= 1
            if self.evictions is not None:
                self.evictions.append((block.block_id, block.block_hash))
        block.block_hash = None

    def cache_loaded_block(self, block: KVCacheBlock, key: BlockHash) -> None:
        """Indexes a block whose page was just loaded from the offloading tier under its key (a
        block already indexed under the key, computed meanwhile, keeps it)."""
        if not self.enable_caching or block.block_hash is not None or key in self.cached_blocks:
            return
        block.block_hash = key
        self.cached_blocks[key] = block
        self.dirty_block_ids.add(block.block_id)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Takes a reference on blocks found in the prefix cache, reviving free ones (the null
        block, a sliding window's placeholder, is skipped)."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                if self._is_indexed(block):
                    self.num_cached_free_blocks -= 1
            block.ref_cnt += 1
            self.dirty_block_ids.add(block.block_id)

    def cache_full_blocks(
        self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash], start: int, end: int, group_id: int = 0
    ) -> None:
        """Indexes blocks[start:end], which are now full, under their content hashes in ``group_id``."""
        if not self.enable_caching:
            return
        for i in range(start, end):
            block, block_hash = blocks[i], group_block_hash(block_hashes[i], group_id)
            if block.block_hash is not None or block is self.null_block:
                continue  # a prefix hit (already indexed), or an entry a sliding window left behind
            block.block_hash = block_hash
            self.dirty_block_ids.add(block.block_id)
            # If an identical block is already indexed (computed twice by requests that raced),
            # keep the older one findable; this one is freed like any uncached block.
            self.cached_blocks.setdefault(block_hash, block)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference on each block (the null block is skipped); blocks should come in
        eviction order."""
        for block in ordered_blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            self.dirty_block_ids.add(block.block_id)
            if block.ref_cnt == 0:
                if self._is_indexed(block):
                    self.num_cached_free_blocks += 1
                else:
                    block.block_hash = None  # a duplicate nobody can find: plain free block
                self.free_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix; refused while any block is in use by a request."""
        if self.num_used_blocks:
            return False
        for block in self.cached_blocks.values():
            block.block_hash = None
            self.dirty_block_ids.add(block.block_id)
        self.cached_blocks.clear()
        self.num_cached_free_blocks = 0
        return True

    def check_integrity(self) -> None:
        """Raises if the pool's bookkeeping is inconsistent: for tests and debugging."""
        free_ids = self.free_queue.block_ids()
        if len(free_ids) != self.free_queue.num_free_blocks or len(set(free_ids)) != len(free_ids):
            raise RuntimeError("free queue is corrupted")
        num_used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        if any(self.blocks[i].ref_cnt != 0 for i in free_ids):
            raise RuntimeError("a free block has references")
        null = self.null_block
        if null is not None and (null.ref_cnt or null.block_hash is not None or null.block_id in free_ids):
            raise RuntimeError("the null block is owned, cached or free")
        if num_used + len(free_ids) + self.num_reserved_blocks != self.num_blocks:
            raise RuntimeError(
                f"free ({len(free_ids)}) + used ({num_used}) + reserved ({self.num_reserved_blocks}) != total ({self.num_blocks})"
            )
        for block_hash, block in self.cached_blocks.items():
            if block.block_hash != block_hash:
                raise RuntimeError(f"block {block.block_id} is indexed under a hash it does not carry")
        num_cached_free = sum(1 for b in self.cached_blocks.values() if b.ref_cnt == 0)
        if num_cached_free != self.num_cached_free_blocks:
            raise RuntimeError(f"{self.num_cached_free_blocks} cached free blocks counted, {num_cached_free} found")
