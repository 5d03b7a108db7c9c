"""Maps requests to their KV blocks: prefix-cache lookup, growth on demand, freeing.

One block pool serves every KV cache group (pagellm.core.kv_cache_groups); each request has one
block table per group, kept by that group's ``SingleTypeKVCacheManager``. A step's allocation is
sized across all groups before anything changes, so it fits whole or fails whole and the
scheduler preempts as it would for a one-group cache.
"""
from __future__ import annotations

from typing import Iterable, Optional

from pagellm.core.block_hash import BlockHash, group_block_hash, group_of_block_hash
from pagellm.core.block_pool import KVCacheBlock
from pagellm.core.kv_cache_base import KVCacheBlocks, KVCacheManagerBase, register_kv_cache_manager
from pagellm.core.kv_cache_groups import KVCacheLayout, single_group_layout
from pagellm.core.kv_tier import KVTier, TierLoad, state_tier_key
from pagellm.core.single_type_manager import SingleTypeKVCacheManager
from pagellm.core.state_cache import StateCacheManager, StateStep
from pagellm.request import Request


@register_kv_cache_manager("paged")
class KVCacheManager(KVCacheManagerBase):
    """Blocks on demand, shared through the prefix cache when ``enable_caching``."""

    supports_sliding_window = True
    supports_recurrent_state = True

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        enable_caching: bool,
        kv_cache_layout: Optional[KVCacheLayout] = None,
        num_state_slots: int = 0,
        state_checkpoint_interval: Optional[int] = None,
        num_state_draft_slots: int = 0,
    ) -> None:
        # The manager reads only the groups' windows; without a layout, one full-attention group.
        layout = kv_cache_layout if kv_cache_layout is not None else single_group_layout(1)
        super().__init__(num_blocks, block_size, max_model_len, enable_caching, layout.has_sliding_groups)
        self.kv_cache_layout = layout
        self.group_managers = [
            SingleTypeKVCacheManager(self.block_pool, block_size, group_id, group.sliding_window)
            for group_id, group in enumerate(layout.groups)
        ]
        self.req_to_blocks = self.group_managers[0].req_to_blocks
        # A hybrid model's recurrent layers: a state slot per request, checkpoints for prefix hits.
        self.state_cache: Optional[StateCacheManager] = None
        if layout.has_state:
            if state_checkpoint_interval is None:
                raise ValueError("a layout with recurrent layers needs state_checkpoint_interval (EngineConfig's)")
            # Tokens between checkpoints, in whole blocks.
            interval = max(block_size, state_checkpoint_interval // block_size * block_size)
            self.state_cache = StateCacheManager(num_state_slots, block_size, interval, enable_caching, num_state_draft_slots)
        self.tier: Optional[KVTier] = None  # the offloading tier under the prefix cache (enable_tier)

    @property
    def num_kv_cache_groups(self) -> int:
        return len(self.group_managers)

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest run of the request's leading full blocks every group can serve from the cache.

        A full-attention group needs all the hit's blocks, a sliding group only those its window
        reaches from the first token after the hit; the hit is the longest length all groups
        agree on (each group's answer can only shorten it, so this settles in a few rounds).

        The last prompt token is never taken from the cache: the model must run on at least one
        token to produce the logits for the next one. Requests asking for prompt logprobs need
        every prompt position's logits, so they skip the cache.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return KVCacheBlocks(), 0
        num_blocks = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        num_blocks, hits = self._agreed_hit(request, num_blocks)
        state = self.state_cache
        if state is not None:
            num_attention_blocks = num_blocks
            while num_blocks:  # the recurrent layers resume only from a state saved where the hit ends
                num_state_blocks = state.find_checkpoint(request.block_hashes, num_blocks)
                if num_state_blocks == num_blocks:
                    break
                num_blocks, hits = self._agreed_hit(request, num_state_blocks)  # shorter each round
            state.note_hit(request.request_id, num_attention_blocks, num_blocks)
        if num_blocks == 0:
            hits = [[] for _ in self.group_managers]
        num_hit_tokens = num_blocks * self.block_size
        return KVCacheBlocks(tuple(hits[0]), tuple(tuple(h) for h in hits[1:])), num_hit_tokens

    def _agreed_hit(self, request: Request, num_blocks: int) -> tuple[int, list[list[KVCacheBlock]]]:
        """The longest hit of at most ``num_blocks`` blocks that every attention group serves."""
        hits: list[list[KVCacheBlock]] = []
        while len(hits) < len(self.group_managers):
            hit = self.group_managers[len(hits)].find_longest_cache_hit(request.block_hashes, num_blocks)
            if len(hit) < num_blocks:
                num_blocks, hits = len(hit), []  # shorter: every group answers again for this length
                if num_blocks == 0:
                    break
                continue
            hits.append(hit)
        return num_blocks, hits

    def num_blocks_needed(self, request: Request, num_new_tokens: int, new_computed_blocks: Optional[KVCacheBlocks] = None) -> int:
        """Free-queue blocks a step would take, all groups together, less what its window releases."""
        computed = self._computed_by_group(new_computed_blocks)
        first = request.num_computed_tokens + len(computed[0]) * self.block_size
        total = 0
        for manager, blocks in zip(self.group_managers, computed):
            total += manager.num_new_blocks(request.request_id, first + num_new_tokens, blocks)
            total -= manager.num_releasable_blocks(request.request_id, first)
        return total

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Optional[KVCacheBlocks] = None,
        num_draft_tokens: int = 0,
    ) -> Optional[KVCacheBlocks]:
        """Makes room for ``num_new_tokens`` more tokens of ``request`` in every group.

        ``new_computed_blocks`` are prefix-cache hits being adopted at admission;
        ``num_draft_tokens`` of the new tokens are drafts the step verifies. Sliding groups
        first release the blocks the step's first query no longer reaches. Returns the newly
        allocated blocks per group, or None (changing nothing) when the pool cannot supply them.
        """
        computed = self._computed_by_group(new_computed_blocks)
        req_id = request.request_id
        # The first position this step computes: what its queries' windows are measured from.
        first = request.num_computed_tokens + len(computed[0]) * self.block_size
        num_tokens = first + num_new_tokens
        if self.num_blocks_needed(request, num_new_tokens, new_computed_blocks) > self.block_pool.num_free_blocks:
            return None
        state = self.state_cache
        if state is not None and not state.has_live_slot(req_id) and not state.can_admit(request, len(computed[0])):
            return None
        # Every group adopts its hits before any takes new blocks: a hit that sits in the free
        # queue must leave it before another group's allocation could evict and reuse it.
        for manager, blocks in zip(self.group_managers, computed):
            manager.remove_skipped_blocks(req_id, first)
            manager.save_computed_blocks(req_id, blocks)
        new_blocks = [manager.allocate_new_blocks(req_id, num_tokens) for manager in self.group_managers]
        if self.enable_caching:
            # Blocks that this step fills are indexed right away: a request admitted later in the
            # same step reads them after this step's forward pass has written them in each layer
            # (every backend writes the batch's K/V before attending), so a burst of requests
            # behind one new prefix computes it once.
            num_full = min(num_tokens // self.block_size, len(request.block_hashes))
            for manager in self.group_managers:
                manager.cache_blocks(request, num_full)
        if state is not None:
            state.allocate(request, len(computed[0]), first, num_tokens, num_draft_tokens)
        return KVCacheBlocks(tuple(new_blocks[0]), tuple(tuple(b) for b in new_blocks[1:]))

    def _computed_by_group(self, new_computed_blocks: Optional[KVCacheBlocks]) -> tuple[tuple[KVCacheBlock, ...], ...]:
        if new_computed_blocks is None or not any(new_computed_blocks.groups):
            return tuple(() for _ in self.group_managers)
        groups = new_computed_blocks.groups
        if len(groups) != len(self.group_managers) or len({len(g) for g in groups}) != 1:
            raise ValueError(
                f"computed blocks must cover the same tokens in each of the {len(self.group_managers)} groups, "
                f"got {[len(g) for g in groups]} blocks"
            )
        return groups

    def free(self, request: Request) -> None:
        for manager in self.group_managers:
            manager.free(request.request_id)
        if self.state_cache is not None:
            self.state_cache.free(request.request_id)
        if self.tier is not None:
            self.tier.tried.discard(request.request_id)
            load = self.tier.loads.get(request.request_id)
            if load is not None:
                load.aborted = True  # its blocks are being written: they go back when the load ends

    # ---- the offloading tier (pagellm.core.kv_tier) ---------------------------------------

    def enable_tier(self, keys: Iterable[BlockHash]) -> None:
        """Puts an offloading tier under the prefix cache, holding ``keys`` (what it found at start:
        pages, and a hybrid model's states)."""
        if not self.enable_caching:
            raise ValueError("KV offloading keeps prefix-cache blocks: it needs prefix caching on")
        self.tier = KVTier.with_keys(keys)
        self.block_pool.evictions = []
        if self.state_cache is not None:
            self.state_cache.enable_tier()

    def tier_hit(self, request: Request, num_hit_tokens: int) -> int:
        """Token blocks that continue the request's memory hit in the tier (every group's page; a
        hybrid model's pages in the pool or the tier, and a state where they end)."""
        tier = self.tier
        if tier is None or request.request_id in tier.tried or request.sampling_params.prompt_logprobs is not None:
            return 0
        last = min((request.num_tokens - 1) // self.block_size, len(request.block_hashes))
        first = num_hit_tokens // self.block_size
        if self.state_cache is not None:
            return self._hybrid_tier_hit(request, first, last)
        num_blocks = 0
        for i in range(first, last):
            if not all(group_block_hash(request.block_hashes[i], g) in tier.keys for g in range(len(self.group_managers))):
                break
            num_blocks += 1
        return num_blocks

    def _hybrid_tier_hit(self, request: Request, first: int, last: int) -> int:
        """The recurrent layers resume only from a state saved where the hit ends: the most blocks
        past ``first`` whose pages are each in the pool or the tier and at whose end a state is in
        either, one of them at least from the tier (else the memory hit would have had it)."""
        tier, pool, state = self.tier, self.block_pool, self.state_cache
        num_blocks, pages_from_tier = 0, False
        for i in range(first, last):
            block_hash = request.block_hashes[i]
            for g in range(len(self.group_managers)):
                if pool.get_cached_block(block_hash, g) is None:
                    if group_block_hash(block_hash, g) not in tier.keys:
                        return num_blocks
                    pages_from_tier = True
            if state.pool.get_cached_block(block_hash) is not None:
                if pages_from_tier:
                    num_blocks = i + 1 - first
            elif state_tier_key(block_hash) in tier.keys:
                num_blocks = i + 1 - first
        return num_blocks

    def start_tier_load(self, request: Request, computed: Optional[KVCacheBlocks], num_hit_tokens: int, num_blocks: int) -> bool:
        """Allocates blocks for ``num_blocks`` token blocks after the hit and orders their pages
        loaded; False (changing nothing) when the pool cannot spare them."""
        tier, pool = self.tier, self.block_pool
        num_groups = len(self.group_managers)
        if tier is None:
            return False
        first = num_hit_tokens // self.block_size
        held = [b for group in self._computed_by_group(computed) for b in group]
        # (token block, key) of each page to load; a hybrid model's pages the pool holds are held instead.
        wanted: list[tuple[int, BlockHash]] = []
        for j in range(num_blocks):
            block_hash = request.block_hashes[first + j]
            for g in range(num_groups):
                cached = pool.get_cached_block(block_hash, g) if self.state_cache is not None else None
                if cached is not None:
                    held.append(cached)
                else:
                    wanted.append((j, group_block_hash(block_hash, g)))
        pool.touch(held)  # before allocating, which could otherwise evict them
        if len(wanted) > pool.num_free_blocks:
            pool.free_blocks(reversed(held))
            return False
        load = TierLoad([], [], held, num_groups, item_blocks=[j for j, _ in wanted], num_blocks=num_blocks)
        state = self.state_cache
        if state is not None:
            end_hash = request.block_hashes[first + num_blocks - 1]
            if state.pool.get_cached_block(end_hash) is not None:
                load.held_state = state.hold_for_tier(end_hash)
            else:
                load.state_slot, load.state_hash = state.slot_for_tier(), end_hash
            if load.held_state is None and load.state_slot is None:  # no slot to spare now
                pool.free_blocks(reversed(held))
                return False
        load.blocks = pool.get_new_blocks(len(wanted))
        load.items = [(b.block_id, key) for b, (_, key) in zip(load.blocks, wanted)]
        tier.loads[request.request_id] = load
        tier.new_loads[request.request_id] = load.sent
        tier.tried.add(request.request_id)
        tier.stats.num_loads += 1
        return True

    def take_tier_orders(self) -> tuple[list[tuple[int, BlockHash]], dict[str, list[tuple[int, BlockHash]]]]:
        """The step's saves (pages the pool handed out again, a hybrid model's checkpoints the slot
        pool did) and loads, for the worker."""
        if self.tier is None:
            return [], {}
        evicted = self.block_pool.evictions or []
        self.block_pool.evictions = []
        if self.state_cache is not None:
            evicted += [(slot, state_tier_key(h)) for slot, h in self.state_cache.take_evictions()]
        self.tier.note_evicted(evicted)
        return self.tier.take_orders()

    def tier_flush_orders(self) -> list[tuple[int, BlockHash]]:
        """Every cached block (and checkpoint) the tier lacks, to save now (at shutdown): their keys join the tier."""
        if self.tier is None:
            return []
        saves = [(block.block_id, key) for key, block in self.block_pool.cached_blocks.items() if key not in self.tier.keys]
        if self.state_cache is not None:
            for block_hash, slot in self.state_cache.pool.cached_blocks.items():
                if state_tier_key(block_hash) not in self.tier.keys:
                    saves.append((slot.block_id, state_tier_key(block_hash)))
        self.tier.note_evicted(saves)
        return self.tier.take_orders()[0]

    def finish_tier_loads(self, loaded: dict[str, int], removed: Iterable[BlockHash]) -> list[str]:
        """The worker's report: per request, how many leading items loaded (the rest failed; a
        hybrid model's state counts first), and keys the tier dropped. The loaded blocks join the
        prefix cache and a loaded state is a checkpoint; returns the requests whose loads ended
        and that wait to be admitted."""
        tier, pool = self.tier, self.block_pool
        if tier is None:
            return []
        tier.forget(removed)
        ended = []
        for req_id, num_ok in loaded.items():
            load = tier.loads.pop(req_id, None)
            if load is None:
                continue
            sent = load.sent
            if num_ok < len(sent):
                tier.forget([sent[num_ok][1]])
            if self.state_cache is None:
                self._finish_pages(load, num_ok)
            else:
                self._finish_hybrid(load, num_ok, num_ok == len(sent))
            # Deepest pages first into the free queue: evicted before the prefix they continue.
            pool.free_blocks(reversed(load.blocks))
            pool.free_blocks(reversed(load.held))
            if not load.aborted:
                ended.append(req_id)
        return ended

    def _finish_pages(self, load: TierLoad, num_ok: int) -> None:
        stats = self.tier.stats
        num_ok_blocks = num_ok // load.num_groups
        for (_, key), block in zip(load.items[: num_ok_blocks * load.num_groups], load.blocks):
            self.block_pool.cache_loaded_block(block, key)
        stats.num_blocks_loaded += num_ok_blocks
        stats.num_blocks_failed += len(load.items) // load.num_groups - num_ok_blocks
        stats.num_hit_tokens += num_ok_blocks * self.block_size

    def _finish_hybrid(self, load: TierLoad, num_ok: int, complete: bool) -> None:
        """A hybrid load's pages and state: each item loaded is kept (a page in the prefix cache,
        the state as a checkpoint); the hit counts only when all of them loaded."""
        stats, state = self.tier.stats, self.state_cache
        num_ok_pages = num_ok
        if load.state_slot is not None:
            state_ok = num_ok >= 1
            num_ok_pages = max(0, num_ok - 1)
            state.release_tier_slot(load.state_slot, load.state_hash if state_ok else None)
            stats.num_states_loaded += state_ok
            stats.num_states_failed += not state_ok
        if load.held_state is not None:
            state.release_tier_slot(load.held_state)
        for (_, key), block in zip(load.items[:num_ok_pages], load.blocks):
            self.block_pool.cache_loaded_block(block, key)
        tier_blocks = set(load.item_blocks)
        failed = set(load.item_blocks[num_ok_pages:])
        stats.num_blocks_loaded += len(tier_blocks - failed)
        stats.num_blocks_failed += len(failed)
        if complete:
            stats.num_hit_tokens += load.num_blocks * self.block_size

    # ---- a hybrid model's recurrent state (pagellm.core.state_cache) --------------------

    def take_state_steps(self) -> dict[str, StateStep]:
        return self.state_cache.take_steps() if self.state_cache is not None else {}

    def finish_step(self) -> None:
        if self.state_cache is not None:
            self.state_cache.finish_step()

    def accept_drafts(self, request: Request, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        if self.state_cache is not None:
            self.state_cache.accept_drafts(request.request_id, num_draft_tokens, num_accepted_tokens)

    def waits_for_pending(self, request: Request, num_hit_tokens: int) -> bool:
        return self.state_cache is not None and self.state_cache.waits_for_pending(request, num_hit_tokens)

    def reset_prefix_cache(self) -> bool:
        if self.state_cache is not None and not self.state_cache.reset_prefix_cache():
            return False
        return self.block_pool.reset_prefix_cache()

    @property
    def group_tables(self) -> list[dict[str, list[KVCacheBlock]]]:
        return [m.req_to_blocks for m in self.group_managers]

    def get_block_ids_by_group(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in m.req_to_blocks.get(request_id, ())] for m in self.group_managers)

    def num_held_blocks(self, request_id: str) -> int:
        return sum(m.num_held_blocks(request_id) for m in self.group_managers)

    def check_integrity(self) -> None:
        """Raises if the pool's reference counts disagree with the tables of all groups, or a
        group's table or cached block breaks its rules."""
        pool = self.block_pool
        pool.check_integrity()
        if self.state_cache is not None:
            self.state_cache.check_integrity()
        owners: dict[int, int] = {}
        for load in self.tier.loads.values() if self.tier is not None else ():
            for b in (*load.blocks, *load.held):
                if not pool.is_null(b):
                    owners[b.block_id] = owners.get(b.block_id, 0) + 1
        owner_group: dict[int, int] = {}
        for manager in self.group_managers:
            manager.check_tables()
            for blocks in manager.req_to_blocks.values():
                for b in blocks:
                    if pool.is_null(b):
                        continue
                    owners[b.block_id] = owners.get(b.block_id, 0) + 1
                    if owner_group.setdefault(b.block_id, manager.group_id) != manager.group_id:
                        raise RuntimeError(f"block {b.block_id} is held by groups {owner_group[b.block_id]} and {manager.group_id}")
        for block in pool.blocks:
            if owners.get(block.block_id, 0) != block.ref_cnt:
                raise RuntimeError(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} but {owners.get(block.block_id, 0)} owners"
                )
        if self.num_kv_cache_groups > 1:
            # A block is cached under one group's key only, and held only by that group's tables.
            for manager in self.group_managers:
                for req_id, blocks in manager.req_to_blocks.items():
                    for b in blocks:
                        if b.block_hash is not None and group_of_block_hash(b.block_hash) != manager.group_id:
                            raise RuntimeError(f"block {b.block_id} of request {req_id} is cached for another group")

