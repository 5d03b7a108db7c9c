"""The layer side of LoRA: each adapted linear layer's pool of adapter weights, the per-step
segments of the flat batch (vLLM's PunicaWrapper metadata), and the one grouped product that adds
every segment's delta after the layer's base product.

A fused projection (q/k/v, gate/up) keeps one pool per shard, so a step reads each adapter's B
once (a block-diagonal B over all shards would read zeros for the others), and a shard that no
loaded adapter targets is skipped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch


def lora_shrink_expand(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    seg_starts: torch.Tensor,
    seg_slots: torch.Tensor,
) -> None:
    """For each segment ``i`` with slot ``k = seg_slots[i] >= 0``, rows ``a:b`` =
    ``seg_starts[i]:seg_starts[i + 1]``: ``y[a:b] += (x[a:b] @ lora_a[k].T) @ lora_b[k].T``.

    ``x [T, in]`` and ``y [T, out]`` float32, ``lora_a [num_slots, max_rank, in]``, ``lora_b
    [num_slots, out, max_rank]`` (scaling folded into B; float32 or bfloat16), ``seg_starts`` int64
    ``[S + 1]``, ``seg_slots`` int64 ``[S]``. The torch stand-in for the native grouped kernel,
    which takes exactly this signature."""
    num_threads = torch.get_num_threads()
    # Its products are small: on one thread none waits for a busy OpenMP pool (which costs more
    # than the arithmetic when other processes share the cores).
    torch.set_num_threads(1)
    try:
        _shrink_expand(y, x, lora_a, lora_b, seg_starts.tolist(), seg_slots.tolist())
    finally:
        torch.set_num_threads(num_threads)


def _shrink_expand(
    y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, starts: list[int], seg_slots: list[int]
) -> None:
    segments = [(starts[i], starts[i + 1], slot) for i, slot in enumerate(seg_slots) if slot >= 0 and starts[i + 1] > starts[i]]
    if not segments:
        return
    length = segments[0][1] - segments[0][0]
    if len(segments) > 1 and all(b - a == length for a, b, _ in segments):
        # Equal segments (decode steps: one row per request) as two batched products, not two per segment.
        slot_ids = [slot for _, _, slot in segments]
        slots = torch.tensor(slot_ids, dtype=torch.int64, device=x.device)
        rows = torch.tensor([r for a, b, _ in segments for r in range(a, b)], dtype=torch.int64, device=x.device)
        xs = x.index_select(0, rows).view(len(segments), length, -1)
        pooled = lora_a.dtype == x.dtype and lora_b.dtype == y.dtype and len(set(slot_ids)) == len(slot_ids)
        if pooled and 2 * len(slot_ids) >= lora_a.shape[0]:
            # Most slots in use: the rows move to their slots' places and the pools are read in
            # place, instead of copying each segment's adapter out first.
            by_slot = x.new_zeros((lora_a.shape[0], length, x.shape[1]))
            by_slot[slots] = xs
            expanded = torch.bmm(torch.bmm(by_slot, lora_a.transpose(1, 2)), lora_b.transpose(1, 2))[slots]
        else:
            shrunk = torch.bmm(xs, lora_a.index_select(0, slots).to(x.dtype).transpose(1, 2))
            expanded = torch.bmm(shrunk, lora_b.index_select(0, slots).to(y.dtype).transpose(1, 2))
        y.index_add_(0, rows, expanded.view(len(rows), -1))
        return
    for a, b, slot in segments:
        shrunk = x[a:b] @ lora_a[slot].to(x.dtype).T
        y[a:b].addmm_(shrunk, lora_b[slot].to(y.dtype).T)


@dataclass(frozen=True)
class LoRABatch:
    """One step's flat batch cut into runs of rows that use the same slot (-1: the base model)."""

    seg_starts: torch.Tensor  # int64 [S + 1]
    seg_slots: torch.Tensor  # int64 [S]

    @staticmethod
    def from_rows(num_rows: list[int], slots: list[int]) -> Optional["LoRABatch"]:
        """Segments of requests laid out one after another (``num_rows`` each, slot ``slots``
        each), neighbours with one slot merged; None when no request has an adapter."""
        if all(slot < 0 for slot in slots):
            return None
        starts, seg_slots = [0], []
        for rows, slot in zip(num_rows, slots):
            if seg_slots and seg_slots[-1] == slot:
                starts[-1] += rows
                continue
            seg_slots.append(slot)
            starts.append(starts[-1] + rows)
        return LoRABatch(torch.tensor(starts, dtype=torch.int64), torch.tensor(seg_slots, dtype=torch.int64))


class LoRAStepContext:
    """What every adapted layer reads during a forward pass: the step's segments (None: no row of
    this step has an adapter, and layers keep their fast fused paths)."""

    def __init__(self) -> None:
        self.batch: Optional[LoRABatch] = None


@dataclass
class ShardPool:
    """One output shard's adapters: ``lora_a [num_slots, max_rank, in]``, ``lora_b [num_slots, rows, max_rank]``."""

    offset: int
    rows: int
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    # Slots whose adapter targets this shard; a shard none targets costs nothing.
    slots: set[int] = field(default_factory=set)


class LoRALayerWeights:
    """One linear layer's adapter pool, one :class:`ShardPool` per shard of a fused projection
    (q/k/v, gate/up; one for a plain layer), set and cleared one slot at a time."""

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],
        num_slots: int,
        max_rank: int,
        context: LoRAStepContext,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.in_features = in_features
        self.max_rank = max_rank
        self.context = context
        self.shards: dict[str, ShardPool] = {}
        offset = 0
        for name, rows in shard_sizes.items():
            self.shards[name] = ShardPool(
                offset,
                rows,
                torch.zeros((num_slots, max_rank, in_features), dtype=dtype, device=device),
                torch.zeros((num_slots, rows, max_rank), dtype=dtype, device=device),
            )
            offset += rows

    @property
    def active(self) -> bool:
        return self.context.batch is not None

    @property
    def nbytes(self) -> int:
        return sum(p.lora_a.nbytes + p.lora_b.nbytes for p in self.shards.values())

    def set_slot(self, slot: int, shards: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Writes an adapter into ``slot``: per shard name, ``(A [r, in], B [rows, r])``, B already
        scaled; smaller ranks are zero-padded to ``max_rank``."""
        self.clear_slot(slot)
        for name, (a, b) in shards.items():
            pool = self.shards[name]
            rank = a.shape[0]
            if a.shape[1] != self.in_features or tuple(b.shape) != (pool.rows, rank) or rank > self.max_rank:
                raise ValueError(
                    f"LoRA shard {name or 'weight'}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit a layer of "
                    f"{self.in_features} inputs and {pool.rows} outputs at rank <= {self.max_rank}"
                )
            pool.lora_a[slot, :rank] = a.to(pool.lora_a.dtype)
            pool.lora_b[slot, :, :rank] = b.to(pool.lora_b.dtype)
            pool.slots.add(slot)

    def clear_slot(self, slot: int) -> None:
        for pool in self.shards.values():
            if slot in pool.slots:
                pool.lora_a[slot].zero_()
                pool.lora_b[slot].zero_()
                pool.slots.discard(slot)

    def add_delta(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """Adds this step's adapters' deltas to the base product ``y`` of ``x``, in place."""
        batch = self.context.batch
        if batch is None:
            return
        if len(self.shards) == 1:
            pool = next(iter(self.shards.values()))
            lora_shrink_expand(y, x, pool.lora_a, pool.lora_b, batch.seg_starts, batch.seg_slots)
            return
        for pool in self.shards.values():
            if pool.slots:
                # The product takes whole rows of y: a shard's delta goes through its own buffer.
                part = torch.zeros((y.shape[0], pool.rows), dtype=y.dtype, device=y.device)
                lora_shrink_expand(part, x, pool.lora_a, pool.lora_b, batch.seg_starts, batch.seg_slots)
                y[:, pool.offset : pool.offset + pool.rows] += part
