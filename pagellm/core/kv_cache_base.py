"""The scheduler's view of a KV cache manager, and the registry of implementations by name.

The scheduler speaks only this interface; the paged manager (``"paged"``) is pagellm's, and the
benchmarks register the pre-PagedAttention layout (``"contiguous"``) beside it to measure what
paging buys. Every implementation keeps its blocks in a ``BlockPool`` and a block table per
request (one per KV cache group, pagellm.core.kv_cache_groups), so the model runner and the
attention kernels serve all of them unchanged.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterable, Optional, TypeVar

from pagellm.core.block_pool import BlockPool, KVCacheBlock
from pagellm.core.kv_cache_groups import KVCacheLayout
from pagellm.request import Request


@dataclass
class PrefixCacheStats:
    """Cumulative, counted in tokens as vLLM reports them; readers take differences."""

    num_queries: int = 0  # prompt tokens looked up
    num_hits: int = 0  # of those, found in the cache
    num_requests: int = 0

    def record(self, num_queries: int, num_hits: int) -> None:
        self.num_requests += 1
        self.num_queries += num_queries
        self.num_hits += num_hits


@dataclass(frozen=True)
class KVCacheBlocks:
    """Blocks of one request, per KV cache group: handed out by one ``allocate_slots`` call, or
    found in the prefix cache. ``blocks`` is group 0 (a one-group cache's only one)."""

    blocks: tuple[KVCacheBlock, ...] = ()
    extra_groups: tuple[tuple[KVCacheBlock, ...], ...] = ()  # groups 1.. of a hybrid model

    @property
    def groups(self) -> tuple[tuple[KVCacheBlock, ...], ...]:
        return (self.blocks, *self.extra_groups)

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    @property
    def block_ids_by_group(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.groups)


class KVCacheManagerBase(ABC):
    """Owns the block pool and every request's block table (one per KV cache group).

    ``req_to_blocks`` is group 0's tables: for a one-group cache, every block a request holds.
    """

    # Whether sliding-window layers get groups of their own whose old blocks are freed; a manager
    # that cannot is given every layer in one full-attention group (the windows still apply).
    supports_sliding_window: ClassVar[bool] = False

    def __init__(
        self, num_blocks: int, block_size: int, max_model_len: int, enable_caching: bool, reserve_null_block: bool = False
    ) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching, reserve_null_block)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @abstractmethod
    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The request's blocks already in the cache (per group), and how many tokens they cover."""

    @abstractmethod
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Optional[KVCacheBlocks] = None,
        num_draft_tokens: int = 0,
    ) -> Optional[KVCacheBlocks]:
        """Room for ``num_new_tokens`` more tokens (the last ``num_draft_tokens`` of them drafts to
        verify); None, changing nothing, when the pool is short."""

    @abstractmethod
    def free(self, request: Request) -> None:
        """Returns the request's blocks to the pool (it finished, was aborted or preempted)."""

    def record_prefix_hit(self, request: Request, num_hit_tokens: int) -> None:
        """Counts a request's lookup once, when it is admitted (a request that waits, for blocks or
        for a prefix being computed, is looked up again the next step)."""
        if self.enable_caching and request.sampling_params.prompt_logprobs is None:
            self.prefix_cache_stats.record(request.num_tokens, num_hit_tokens)

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def usage(self) -> float:
        return self.block_pool.usage()

    @property
    def num_kv_cache_groups(self) -> int:
        return 1

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    @property
    def group_tables(self) -> list[dict[str, list[KVCacheBlock]]]:
        """Every KV cache group's tables (request id -> blocks); group 0's is ``req_to_blocks``."""
        return [self.req_to_blocks]

    def get_block_ids_by_group(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table in each group (null entries included)."""
        return (self.get_block_ids(request_id),)

    def num_held_blocks(self, request_id: str) -> int:
        """Pool blocks the request holds, all groups together (a shared block counts for each holder)."""
        return len(self.req_to_blocks.get(request_id, ()))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    # A hybrid model's recurrent state (pagellm.core.state_cache): managers without one plan none.
    def take_state_steps(self) -> dict:
        """Each request's state slot, restore and checkpoints for the step just scheduled."""
        return {}

    def finish_step(self) -> None:
        """The scheduled step has run: what it wrote may now be read by later requests."""
        return None

    def accept_drafts(self, request: Request, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """A step verified ``num_draft_tokens`` of ``request``'s drafts and accepted the first
        ``num_accepted_tokens``: a recurrent state rolls back to them (KV needs nothing)."""
        return None

    def waits_for_pending(self, request: Request, num_hit_tokens: int) -> bool:
        """Whether the step being scheduled writes something that lengthens ``request``'s hit."""
        return False

    # The offloading tier under the prefix cache (pagellm.core.kv_tier): managers without one have none.
    def enable_tier(self, keys: Iterable[bytes]) -> None:
        raise ValueError(f"the {type(self).__name__} cannot put an offloading tier under its cache")

    def tier_hit(self, request: Request, num_hit_tokens: int) -> int:
        """Token blocks past the memory hit that the tier holds."""
        return 0

    def start_tier_load(self, request: Request, computed: Optional[KVCacheBlocks], num_hit_tokens: int, num_blocks: int) -> bool:
        return False

    def take_tier_orders(self) -> tuple[list[tuple[int, bytes]], dict[str, list[tuple[int, bytes]]]]:
        return [], {}

    def finish_tier_loads(self, loaded: dict[str, int], removed: Iterable[bytes]) -> list[str]:
        return []

    def tier_flush_orders(self) -> list[tuple[int, bytes]]:
        return []

    def check_integrity(self) -> None:
        """Raises if the pool's reference counts disagree with the block tables."""
        self.block_pool.check_integrity()
        owners: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                owners[b.block_id] = owners.get(b.block_id, 0) + 1
        for block in self.block_pool.blocks:
            if owners.get(block.block_id, 0) != block.ref_cnt:
                raise RuntimeError(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} but {owners.get(block.block_id, 0)} owners"
                )


ManagerT = TypeVar("ManagerT", bound=type[KVCacheManagerBase])
_REGISTRY: dict[str, type[KVCacheManagerBase]] = {}


def register_kv_cache_manager(name: str) -> Callable[[ManagerT], ManagerT]:
    def register(cls: ManagerT) -> ManagerT:
        if _REGISTRY.get(name, cls) is not cls:
            raise ValueError(f"a KV cache manager named {name!r} is already registered")
        _REGISTRY[name] = cls
        return cls

    return register


def kv_cache_manager_names() -> list[str]:
    return sorted(_REGISTRY)


def kv_cache_manager_class(name: str) -> type[KVCacheManagerBase]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown KV cache manager {name!r}; registered: {kv_cache_manager_names()}") from None


def create_kv_cache_manager(
    name: str,
    num_blocks: int,
    block_size: int,
    max_model_len: int,
    enable_caching: bool,
    kv_cache_layout: Optional[KVCacheLayout] = None,
    num_state_slots: int = 0,
    state_checkpoint_interval: Optional[int] = None,
    num_state_draft_slots: int = 0,
) -> KVCacheManagerBase:
    """``kv_cache_layout``: the model's KV cache groups; None is one full-attention group. A layout
    with recurrent layers needs a manager that keeps their state (``num_state_slots`` slots, of
    which each running request holds one and ``num_state_draft_slots`` for its drafts)."""
    cls = kv_cache_manager_class(name)
    if kv_cache_layout is None:
        return cls(num_blocks, block_size, max_model_len, enable_caching)
    if kv_cache_layout.has_state:
        if not getattr(cls, "supports_recurrent_state", False):
            raise ValueError(f"the {name!r} KV cache manager cannot keep a hybrid model's recurrent state; use 'paged'")
        return cls(num_blocks, block_size, max_model_len, enable_caching, kv_cache_layout=kv_cache_layout,
                   num_state_slots=num_state_slots, state_checkpoint_interval=state_checkpoint_interval,
                   num_state_draft_slots=num_state_draft_slots)
    return cls(num_blocks, block_size, max_model_len, enable_caching, kv_cache_layout=kv_cache_layout)
