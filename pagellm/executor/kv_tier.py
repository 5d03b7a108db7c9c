"""A rank's offloading tier: which store holds its pages, the identity that keeps them apart, and
how the ranks' reports become one.

``--kv-offloading-backend native`` keeps evicted prefix blocks in host memory; with
``--kv-offloading-dir`` in files that outlive the server. A file is only ever read back by a server
whose KV bytes would be the same: the identity below (the model's files, dtypes, block size,
layout, parallel layout and this rank) is hashed into the directory's name and every file's header.

Under tensor parallelism each rank keeps its own store of its share of every page (its KV heads,
its part of each recurrent state), saving and loading the same ids on the scheduler's orders. The
scheduler sees one tier: a load is done once every rank finished it, with the fewest items any
rank loaded (a page that failed on one rank is recomputed on all), and a key any rank dropped is
dropped (``TierReportJoiner``); at start it holds the keys every rank found.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields
from typing import Any, Optional

import torch

from pagellm.core.sched_output import ModelRunnerOutput
from pagellm.kv_offload.offloader import KVOffloader, OffloaderStats
from pagellm.kv_offload.store import DiskKVStore, HostKVStore, KVStore
from pagellm.plan.kv_cache_plan import KVCachePlan
from pagellm.plan.resolved_config import ResolvedConfig
from pagellm.worker.kv_cache import distinct_cache_tensors

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


def tier_identity(
    resolved: ResolvedConfig, kv_cache: KVCachePlan, rank: int, kv_tensors: list[torch.Tensor], state_tensors: tuple[torch.Tensor, ...] = ()
) -> dict[str, Any]:
    """Everything that changes the bytes of a page or state (a LoRA adapter or tenant salt is in the keys)."""
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
    if state_tensors:
        identity["state_tensors"] = [(tuple(t.shape[1:]), str(t.dtype)) for t in state_tensors]
    if resolved.draft is not None:
        identity["draft"] = _file_identity(resolved.draft.path)
    return identity


def distinct_kv_tensors(kv_caches: list[Any], draft_caches: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors a block's page spans, each once and whole (a grouped cache shares tensors between
    layers, a narrow layer's view pads into a wider one's); a draft model's cache rides along, since
    it shares the block ids."""
    return distinct_cache_tensors([*kv_caches, *draft_caches])


def state_tensors_of(kv_caches: list[Any], kv_cache: KVCachePlan) -> tuple[torch.Tensor, ...]:
    """A hybrid model's recurrent layers' state tensors (``[num_slots, ...]``), layer by layer."""
    out: list[torch.Tensor] = []
    for layer in kv_cache.layout.state_layer_ids:
        states = kv_caches[layer]
        out.extend(states if isinstance(states, (tuple, list)) else (states,))
    return tuple(out)


def make_offloader(
    resolved: ResolvedConfig,
    kv_cache: KVCachePlan,
    rank: int,
    kv_tensors: list[torch.Tensor],
    state_tensors: tuple[torch.Tensor, ...] = (),
) -> Optional[KVOffloader]:
    """The rank's offloader over its distinct KV tensors (and a hybrid model's state tensors), or
    None without a tier. ``--kv-offloading-size`` is the tier's size over all ranks, as in vLLM."""
    config = resolved.args
    if config.kv_offloading_backend is None:
        return None
    capacity = int(config.kv_offloading_size * 2**30) // config.tensor_parallel_size
    store: KVStore
    if config.kv_offloading_dir is not None:
        # No fsync per page: a file is published by rename only once whole, and its checksum turns
        # what a power cut may leave half-flushed into a miss; syncing each page would stall the
        # writer so that most saves were dropped.
        identity = tier_identity(resolved, kv_cache, rank, kv_tensors, state_tensors)
        store = DiskKVStore(config.kv_offloading_dir, identity, capacity, fsync=False)
        where = f"in {config.kv_offloading_dir}"
    else:
        store = HostKVStore(capacity)
        where = "in host memory"
    offloader = KVOffloader(kv_tensors, store, max_staged_bytes=min(STAGING_BYTES, capacity), state_tensors=list(state_tensors) or None)
    logger.info(
        "KV offloading tier %s%s: %.3g GiB, %d entries found (pages of %.3g MiB%s)",
        where,
        f" (rank {rank})" if config.tensor_parallel_size > 1 else "",
        capacity / 2**30,
        len(store.keys()),
        offloader.page_bytes / 2**20,
        f", states of {offloader.state_bytes / 2**20:.3g} MiB" if offloader.state_bytes else "",
    )
    return offloader


@dataclass
class RankTierReport:
    """One rank's tier news from a step: loads finished, keys dropped, its counters."""

    loaded: dict[str, int] = field(default_factory=dict)
    removed: list[bytes] = field(default_factory=list)
    stats: Optional[OffloaderStats] = None


def common_keys(per_rank: list[list[bytes]]) -> list[bytes]:
    """The keys every rank's store holds, in rank 0's order (least recently used first)."""
    common = set(per_rank[0]).intersection(*per_rank[1:])
    return [k for k in per_rank[0] if k in common]


class TierReportJoiner:
    """Joins the ranks' tier reports into the one the scheduler reads, step by step.

    A rank may finish a load a step before another; a load is reported once all have, with the
    fewest leading items any rank loaded. A key is dropped once any rank dropped it. Counters of
    bytes are summed over the ranks (each holds its share of every page); the others (pages,
    files, seconds) are the largest any rank has, each rank counting the same pages.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._partial: dict[str, list[Optional[int]]] = {}

    def join(self, reports: list[RankTierReport]) -> RankTierReport:
        if len(reports) != self.world_size:
            raise ValueError(f"{len(reports)} tier reports for {self.world_size} ranks")
        loaded: dict[str, int] = {}
        for rank, report in enumerate(reports):
            for req_id, num_ok in report.loaded.items():
                counts = self._partial.setdefault(req_id, [None] * self.world_size)
                counts[rank] = num_ok
                if all(c is not None for c in counts):
                    loaded[req_id] = min(counts)
                    del self._partial[req_id]
        removed = list(dict.fromkeys(k for report in reports for k in report.removed))
        return RankTierReport(loaded, removed, _join_stats([r.stats for r in reports]))

    def apply(self, output: ModelRunnerOutput, other_ranks: list[Optional[RankTierReport]]) -> None:
        """Rank 0's step output gets every rank's joined tier report in place of its own."""
        if any(r is None for r in other_ranks):
            return  # no tier on these ranks
        own = RankTierReport(output.kv_loads_done, output.kv_tier_removed, output.kv_tier_stats)
        joined = self.join([own, *other_ranks])
        output.kv_loads_done, output.kv_tier_removed, output.kv_tier_stats = joined.loaded, joined.removed, joined.stats

    @property
    def num_partial(self) -> int:
        """Loads some ranks reported and others have not yet."""
        return len(self._partial)


def _join_stats(per_rank: list[Optional[OffloaderStats]]) -> Optional[OffloaderStats]:
    if any(s is None for s in per_rank):
        return per_rank[0]
    joined = {}
    for f in fields(OffloaderStats):
        values = [getattr(s, f.name) for s in per_rank]
        joined[f.name] = sum(values) if "bytes" in f.name else max(values)
    return OffloaderStats(**joined)
