"""A rank's offloading tier: which store holds its pages, and the identity that keeps them apart.

``--kv-offloading-backend native`` keeps evicted prefix blocks in host memory; with
``--kv-offloading-dir`` in files that outlive the server. A file is only ever read back by a server
whose KV bytes would be the same: the identity below (the model's files, dtypes, block size,
layout, parallel layout) is hashed into the directory's name and every file's header.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch

from pagellm.kv_offload.offloader import KVOffloader
from pagellm.kv_offload.store import DiskKVStore, HostKVStore, KVStore
from pagellm.plan.kv_cache_plan import KVCachePlan
from pagellm.plan.resolved_config import ResolvedConfig

logger = logging.getLogger(__name__)

# Bump when the page layout in the KV tensors changes: files of an older layout are never read.
TIER_FORMAT_VERSION = 1
# The only resident memory the tier adds: pages copied out of the cache, waiting to be written.
STAGING_BYTES = 256 * 2**20


def _file_identity(path: str) -> list[tuple[str, int, int]]:
    """(name, size, mtime) of a model's file, or of every file in its directory."""
    path = os.path.realpath(path)
    if os.path.isfile(path):
        st = os.stat(path)
        return [(path, st.st_size, st.st_mtime_ns)]
    out = []
    for name in sorted(os.listdir(path)):
        full = os.path.join(path, name)
        if os.path.isfile(full):
            st = os.stat(full)
            out.append((full, st.st_size, st.st_mtime_ns))
    return out


def tier_identity(resolved: ResolvedConfig, kv_cache: KVCachePlan, rank: int, kv_tensors: list[torch.Tensor]) -> dict[str, Any]:
    """Everything that changes the bytes of a page (a LoRA adapter or tenant salt is in the keys)."""
    identity: dict[str, Any] = {
        "format": TIER_FORMAT_VERSION,
        "model": _file_identity(resolved.model.path),
        "dtype": str(resolved.precision.dtype),
        "kv_cache_dtype": str(resolved.precision.kv_cache_dtype),
        "block_size": kv_cache.block_size,
        "layout": kv_cache.layout.describe(),
        "tensors": [(tuple(t.shape[2:]), str(t.dtype)) for t in kv_tensors],
        "tensor_parallel": (resolved.args.tensor_parallel_size, rank),
    }
    if resolved.draft is not None:
        identity["draft"] = _file_identity(resolved.draft.path)
    return identity


def distinct_kv_tensors(kv_caches: list[Any], draft_caches: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors a block's page spans, each once (a grouped cache shares tensors between layers);
    a draft model's cache rides along, since it shares the block ids."""
    seen: set[int] = set()
    out = []
    for t in [*kv_caches, *draft_caches]:
        if isinstance(t, torch.Tensor) and t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            out.append(t)
    return out


def make_offloader(
    resolved: ResolvedConfig, kv_cache: KVCachePlan, rank: int, kv_tensors: list[torch.Tensor]
) -> Optional[KVOffloader]:
    """The rank's offloader over its distinct KV tensors, or None without a tier."""
    config = resolved.args
    if config.kv_offloading_backend is None:
        return None
    if kv_cache.layout.has_state:
        raise ValueError("the KV offloading tier does not hold a hybrid model's recurrent state yet")
    capacity = int(config.kv_offloading_size * 2**30)
    store: KVStore
    if config.kv_offloading_dir is not None:
        # No fsync per page: a file is published by rename only once whole, and its checksum turns
        # what a power cut may leave half-flushed into a miss; syncing each page would stall the
        # writer so that most saves were dropped.
        identity = tier_identity(resolved, kv_cache, rank, kv_tensors)
        store = DiskKVStore(config.kv_offloading_dir, identity, capacity, fsync=False)
        where = f"in {config.kv_offloading_dir}"
    else:
        store = HostKVStore(capacity)
        where = "in host memory"
    offloader = KVOffloader(kv_tensors, store, max_staged_bytes=min(STAGING_BYTES, capacity))
    logger.info(
        "KV offloading tier %s: %.1f GiB, %d pages found (%.1f MiB each)",
        where,
        capacity / 2**30,
        len(store.keys()),
        offloader.page_bytes / 2**20,
    )
    return offloader
