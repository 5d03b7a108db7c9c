"""The worker's side of the prefix cache's offloading tier: where evicted KV pages are kept
(host memory, or a directory on disk that outlives the server) and the thread that moves pages
(and a hybrid model's recurrent states) between the cache tensors and that store. The scheduler
decides what to save and load (``pagellm.core.kv_tier``); this package only stores and copies, and
imports no other part of pagellm.
"""
from pagellm.kv_offload.offloader import KVOffloader, OffloaderStats, OffloadReport
from pagellm.kv_offload.store import DiskKVStore, HostKVStore, KVStore, KVTierStats

__all__ = ["DiskKVStore", "HostKVStore", "KVOffloader", "KVStore", "KVTierStats", "OffloadReport", "OffloaderStats"]
