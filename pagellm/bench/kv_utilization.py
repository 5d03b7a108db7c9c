"""KV memory accounting that reads the same way for the paged and the contiguous layout.

  * held: tokens whose K/V are actually in the cache, the sum of ``num_computed_tokens`` over
    running requests;
  * reserved: tokens' worth of blocks taken from the pool, ``used blocks * block_size``. Paged,
    a request owns just the blocks its tokens fill, so the gap is the unfilled tail of each
    last block. Contiguous, it owns the whole run reserved for its longest possible length;
  * capacity: the whole pool, ``num_blocks * block_size``.

Utilization is held / reserved: the share of taken memory doing useful work. With prefix
caching, shared blocks are held by several requests yet reserved once, so utilization can
exceed 1; the comparison runs without it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

from pagellm.core.scheduler import SchedulerStats


@dataclass
class KVUsageSample:
    time_s: float  # since the run started
    num_running: int
    num_waiting: int
    num_held_tokens: int
    num_reserved_tokens: int
    num_capacity_tokens: int
    num_block_table_entries: int  # block ids the running requests' tables hold

    @property
    def utilization(self) -> Optional[float]:
        """held / reserved; None while nothing is reserved (an idle cache has no utilization)."""
        return self.num_held_tokens / self.num_reserved_tokens if self.num_reserved_tokens else None

    @property
    def occupancy(self) -> float:
        """held / capacity: the share of the whole budget holding live KV."""
        return self.num_held_tokens / self.num_capacity_tokens

    @property
    def num_wasted_tokens(self) -> int:
        return self.num_reserved_tokens - self.num_held_tokens


def sample_kv_usage(stats: SchedulerStats, block_size: int, time_s: float) -> KVUsageSample:
    """The cache's state from a scheduler snapshot taken between steps, when every scheduled token is computed."""
    return KVUsageSample(
        time_s=time_s,
        num_running=stats.num_running_reqs,
        num_waiting=stats.num_waiting_reqs,
        num_held_tokens=stats.num_running_tokens,
        num_reserved_tokens=stats.num_used_blocks * block_size,
        num_capacity_tokens=stats.num_blocks * block_size,
        num_block_table_entries=stats.num_block_table_entries,
    )


@dataclass
class UtilizationSummary:
    mean_utilization: float
    peak_utilization: float
    mean_occupancy: float
    peak_occupancy: float
    mean_requests_in_flight: float
    max_requests_in_flight: int
    mean_wasted_tokens: float
    mean_block_table_entries: float
    num_samples: int


def summarize(samples: Sequence[KVUsageSample], weights: Optional[Sequence[float]] = None) -> UtilizationSummary:
    """Means weighted by ``weights`` (e.g. each step's duration, for means over time) and peaks.

    Samples with nothing reserved (between static batches, or after the last request) are left
    out of the utilization figures but count for occupancy and requests in flight.
    """
    if not samples:
        raise ValueError("no KV usage samples to summarize")
    w = np.ones(len(samples)) if weights is None else np.asarray(weights, dtype=np.float64)
    if w.shape != (len(samples),) or np.any(w < 0) or w.sum() <= 0:
        raise ValueError("weights must be non-negative, one per sample, and not all zero")
    busy = np.array([s.num_reserved_tokens > 0 for s in samples])
    util = np.array([s.utilization or 0.0 for s in samples])
    occupancy = np.array([s.occupancy for s in samples])
    running = np.array([s.num_running for s in samples], dtype=np.float64)
    wasted = np.array([s.num_wasted_tokens for s in samples], dtype=np.float64)
    entries = np.array([s.num_block_table_entries for s in samples], dtype=np.float64)
    has_busy = bool(busy.any()) and w[busy].sum() > 0
    return UtilizationSummary(
        mean_utilization=float(np.average(util[busy], weights=w[busy])) if has_busy else 0.0,
        peak_utilization=float(util[busy].max()) if busy.any() else 0.0,
        mean_occupancy=float(np.average(occupancy, weights=w)),
        peak_occupancy=float(occupancy.max()),
        mean_requests_in_flight=float(np.average(running, weights=w)),
        max_requests_in_flight=int(running.max()),
        mean_wasted_tokens=float(np.average(wasted[busy], weights=w[busy])) if has_busy else 0.0,
        mean_block_table_entries=float(np.average(entries[busy], weights=w[busy])) if has_busy else 0.0,
        num_samples=len(samples),
    )
