"""The scheduler's side of the KV offloading tier: which prefix blocks it holds, what to save and load.

The tier (host memory, or a directory on disk that outlives the server: ``pagellm.kv_offload``)
sits under the prefix cache. When the pool hands a cached block out again, its page is saved
under its prefix-cache key (the worker copies it out before the step's forward pass overwrites it).
When a new request's prefix runs past what the pool holds but on into keys the tier holds, fresh
blocks are allocated for those pages and the worker loads them beside other requests' steps; the
request waits for its own loads only, then is admitted with them as an ordinary prefix hit.

Only bookkeeping lives here: block ids and keys cross to the worker in the ``SchedulerOutput``,
and the worker reports each request's loads done (and keys the tier dropped) in its output.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from pagellm.core.block_hash import BlockHash
from pagellm.core.block_pool import KVCacheBlock


@dataclass
class KVTierCoreStats:
    """Cumulative counters of the scheduler's side (the bytes and seconds are the worker's)."""

    num_keys: int = 0  # pages the tier holds, as far as the scheduler knows
    num_saves: int = 0  # pages ordered saved (evicted from the pool)
    num_loads: int = 0  # requests that loaded from the tier
    num_blocks_loaded: int = 0  # token blocks loaded (pages of every KV cache group)
    num_blocks_failed: int = 0  # token blocks whose load failed (recomputed instead)
    num_hit_tokens: int = 0  # prompt tokens served from the tier

    def copy(self) -> "KVTierCoreStats":
        return KVTierCoreStats(**self.__dict__)


@dataclass
class TierLoad:
    """One request's load in flight: the pages (token block by token block, every group's page of a
    block in turn, the order of ``items``) and the pool blocks it holds meanwhile."""

    items: list[tuple[int, BlockHash]]  # (block id, key) in load order
    blocks: list[KVCacheBlock]  # the fresh blocks, in ``items`` order
    held: list[KVCacheBlock]  # the memory hit before them, held so it is not evicted meanwhile
    num_groups: int
    aborted: bool = False


@dataclass
class KVTier:
    """The tier's keys and the orders of the step being scheduled."""

    keys: set[BlockHash] = field(default_factory=set)
    loads: dict[str, TierLoad] = field(default_factory=dict)
    tried: set[str] = field(default_factory=set)  # requests that loaded once: never twice in a row
    saves: list[tuple[int, BlockHash]] = field(default_factory=list)
    new_loads: dict[str, list[tuple[int, BlockHash]]] = field(default_factory=dict)
    stats: KVTierCoreStats = field(default_factory=KVTierCoreStats)

    @classmethod
    def with_keys(cls, keys: Iterable[BlockHash]) -> "KVTier":
        tier = cls(keys=set(keys))
        tier.stats.num_keys = len(tier.keys)
        return tier

    def note_evicted(self, evicted: list[tuple[int, BlockHash]]) -> None:
        """Pages the pool is handing out again: saved unless the tier has them already."""
        for block_id, key in evicted:
            if key not in self.keys:
                self.keys.add(key)
                self.saves.append((block_id, key))
                self.stats.num_saves += 1
        self.stats.num_keys = len(self.keys)

    def forget(self, keys: Iterable[BlockHash]) -> None:
        """Keys the tier dropped (evicted for room, a failed write, a damaged file)."""
        self.keys.difference_update(keys)
        self.stats.num_keys = len(self.keys)

    def take_orders(self) -> tuple[list[tuple[int, BlockHash]], dict[str, list[tuple[int, BlockHash]]]]:
        saves, loads = self.saves, self.new_loads
        self.saves, self.new_loads = [], {}
        return saves, loads
