"""Maps requests to their KV blocks: prefix-cache lookup, growth on demand, freeing."""
from __future__ import annotations

from typing import Optional

from pagellm.core.block_pool import KVCacheBlock
from pagellm.core.kv_cache_base import KVCacheBlocks, KVCacheManagerBase, register_kv_cache_manager
from pagellm.request import Request


@register_kv_cache_manager("paged")
class KVCacheManager(KVCacheManagerBase):
    """Blocks on demand, shared through the prefix cache when ``enable_caching``."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, enable_caching: bool) -> None:
        super().__init__(num_blocks, block_size, max_model_len, enable_caching)
        # How many of a request's leading blocks are already indexed in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of the request's leading full blocks found in the prefix cache.

        The last prompt token is never taken from the cache: the model must run on at least one
        token to produce the logits for the next one. Requests asking for prompt logprobs need
        every prompt position's logits, so they skip the cache.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_num_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_stats.record(request.num_tokens, num_hit_tokens)
        return hits, num_hit_tokens

    def num_blocks_needed(self, request: Request, num_new_tokens: int, num_new_computed_blocks: int = 0) -> int:
        num_owned = len(self.req_to_blocks.get(request.request_id, ())) + num_new_computed_blocks
        num_total_tokens = request.num_computed_tokens + num_new_computed_blocks * self.block_size + num_new_tokens
        return max(0, -(-num_total_tokens // self.block_size) - num_owned)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Optional[list[KVCacheBlock]] = None,
    ) -> Optional[KVCacheBlocks]:
        """Makes room for ``num_new_tokens`` more tokens of ``request``.

        ``new_computed_blocks`` are prefix-cache hits being adopted at admission. Returns the newly
        allocated blocks, or None (changing nothing) when the pool cannot supply them.
        """
        new_computed_blocks = new_computed_blocks or []
        num_new_blocks = self.num_blocks_needed(request, num_new_tokens, len(new_computed_blocks))
        # Hits that sit in the free queue stop being allocatable once adopted.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_revived > self.block_pool.num_free_blocks:
            return None
        self.block_pool.touch(new_computed_blocks)
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        if self.enable_caching:
            # Blocks that this step fills are indexed right away: a request admitted later in the
            # same step reads them after this step's forward pass has written them in each layer
            # (every backend writes the batch's K/V before attending), so a burst of requests
            # behind one new prefix computes it once.
            num_computed_after = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
            num_full = min(num_computed_after // self.block_size, len(request.block_hashes))
            start = self.num_cached_blocks.get(request.request_id, 0)
            if num_full > start:
                self.block_pool.cache_full_blocks(blocks, request.block_hashes, start, num_full)
                self.num_cached_blocks[request.request_id] = num_full
        return KVCacheBlocks(tuple(new_blocks))

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        # Tail first: the end of a chain is the least likely part to be shared again.
        self.block_pool.free_blocks(reversed(blocks))
