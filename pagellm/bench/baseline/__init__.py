"""The traditional serving design, kept to measure what PagedAttention and continuous batching buy.

Importing this package registers the ``"contiguous"`` KV cache manager.
"""
from pagellm.bench.baseline.contiguous_kv_cache_manager import (
    RESERVE_MAX_MODEL_LEN,
    RESERVE_MAX_TOKENS,
    RESERVE_MODES,
    ContiguousKVCacheManager,
)
from pagellm.bench.baseline.static_batch_scheduler import StaticBatchScheduler

__all__ = [
    "ContiguousKVCacheManager",
    "RESERVE_MAX_MODEL_LEN",
    "RESERVE_MAX_TOKENS",
    "RESERVE_MODES",
    "StaticBatchScheduler",
]
