"""The scheduler's side of the KV offloading tier: which prefix blocks it holds, what to save and load.

The tier (host memory, or a directory on disk that outlives the server: ``pagellm.kv_offload``)
sits under the prefix cache. When the pool hands a cached block out again, its page is saved
under its prefix-cache key (the worker copies it out before the step's forward pass overwrites it).
When a new request's prefix runs past what the pool holds but on into keys the tier holds, fresh
blocks are allocated for those pages and the worker loads them beside other requests' steps; the
request waits for its own loads only, then is admitted with them as an ordinary prefix hit.

A hybrid model's recurrent state checkpoints go the same way: a checkpoint slot the state pool
hands out again is saved under ``state_tier_key`` of the block hash it ends at, and a prefix that
runs on in the tier (its pages in the pool or the tier, a state where it ends) loads that state
into a free slot, where it is a checkpoint like any other.

Only bookkeeping lives here: block (or slot) ids and keys cross to the worker in the
``SchedulerOutput`` (a state's key says it is one), and the worker reports each request's loads
done (and keys the tier dropped) in its output; under tensor parallelism the executor has joined
the ranks' reports into one, as if one rank held every page.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

from pagellm.core.block_hash import BlockHash
from pagellm.core.block_pool import KVCacheBlock

# Appended to a checkpoint's block hash: the tier key of that prefix's recurrent state, which is
# not any KV cache group's page (group keys end in a 4-byte group id after their own tag).
_STATE_TAG = b"\x00state"


def state_tier_key(block_hash: BlockHash) -> BlockHash:
    """The tier key of the recurrent state saved where the block ``block_hash`` ends."""
    return block_hash + _STATE_TAG


def is_state_key(key: BlockHash) -> bool:
    return key.endswith(_STATE_TAG)


@dataclass
class KVTierCoreStats:
    """Cumulative counters of the scheduler's side (the bytes and seconds are the worker's)."""

    num_keys: int = 0  # pages (and states) the tier holds, as far as the scheduler knows
    num_saves: int = 0  # pages ordered saved (evicted from the pool)
    num_loads: int = 0  # requests that loaded from the tier
    num_blocks_loaded: int = 0  # token blocks loaded (pages of every KV cache group)
    num_blocks_failed: int = 0  # token blocks whose load failed (recomputed instead)
    num_hit_tokens: int = 0  # prompt tokens served from the tier
    num_state_saves: int = 0  # recurrent states ordered saved (checkpoints evicted from the slot pool)
    num_states_loaded: int = 0
    num_states_failed: int = 0

    def copy(self) -> "KVTierCoreStats":
        return KVTierCoreStats(**self.__dict__)


@dataclass
class TierLoad:
    """One request's load in flight: the pages (token block by token block, every group's page of a
    block in turn, the order of ``items``) and the pool blocks it holds meanwhile; for a hybrid
    model, the state the prefix resumes from (loaded first into ``state_slot``, or a checkpoint in
    memory held as ``held_state``)."""

    items: list[tuple[int, BlockHash]]  # (block id, key) in load order
    blocks: list[KVCacheBlock]  # the fresh blocks, in ``items`` order
    held: list[KVCacheBlock]  # the memory hit before them (and pages among them), held so they are not evicted meanwhile
    num_groups: int
    aborted: bool = False
    item_blocks: list[int] = field(default_factory=list)  # each item's token block (hybrid loads; else by ``num_groups``)
    num_blocks: int = 0  # token blocks the load makes a hit (hybrid loads)
    state_slot: Optional[KVCacheBlock] = None  # the fresh slot a state is loaded into
    state_hash: Optional[BlockHash] = None  # the checkpoint's key in the slot pool
    held_state: Optional[KVCacheBlock] = None

    @property
    def sent(self) -> list[tuple[int, BlockHash]]:
        """The items in the order the worker loads them (the state first) and counts them."""
        if self.state_slot is None:
            return self.items
        return [(self.state_slot.block_id, state_tier_key(self.state_hash)), *self.items]


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
                if is_state_key(key):
                    self.stats.num_state_saves += 1
                else:
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
