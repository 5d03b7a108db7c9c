"""The scheduler's view of a KV cache manager, and the registry of implementations by name.

The scheduler speaks only this interface; the paged manager (``"paged"``) is pagellm's, and the
benchmarks register the pre-PagedAttention layout (``"contiguous"``) beside it to measure what
paging buys. Every implementation keeps its blocks in a ``BlockPool`` and a block table per
request, so the model runner and the attention kernels serve all of them unchanged.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

from pagellm.core.block_pool import BlockPool, KVCacheBlock
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
    """Blocks handed to a request by one ``allocate_slots`` call."""

    blocks: tuple[KVCacheBlock, ...] = ()

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


class KVCacheManagerBase(ABC):
    """Owns the block pool and every request's block table."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @abstractmethod
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The request's leading blocks already in the cache, and how many tokens they hold."""

    @abstractmethod
    def allocate_slots(
        self, request: Request, num_new_tokens: int, new_computed_blocks: Optional[list[KVCacheBlock]] = None
    ) -> Optional[KVCacheBlocks]:
        """Room for ``num_new_tokens`` more tokens; None, changing nothing, when the pool is short."""

    @abstractmethod
    def free(self, request: Request) -> None:
        """Returns the request's blocks to the pool (it finished, was aborted or preempted)."""

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def usage(self) -> float:
        return self.block_pool.usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

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


def create_kv_cache_manager(
    name: str, num_blocks: int, block_size: int, max_model_len: int, enable_caching: bool
) -> KVCacheManagerBase:
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown KV cache manager {name!r}; registered: {kv_cache_manager_names()}") from None
    return cls(num_blocks, block_size, max_model_len, enable_caching)
