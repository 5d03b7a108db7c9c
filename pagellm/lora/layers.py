"""The layer side of LoRA: each adapted linear layer's pool of adapter weights, the per-step
segments of the flat batch (vLLM's PunicaWrapper metadata), and the one grouped product that adds
every segment's delta after the layer's base product.

A fused projection (q/k/v, gate/up) holds its shards' adapters block-diagonally: shard ``s``'s A
sits in ranks ``[s * max_rank, s * max_rank + r)`` and its B in the shard's output rows at those
ranks, so one shrink and one expand cover all shards and untargeted shards are zeros.
"""
from __future__ import annotations

from dataclasses import dataclass
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
    starts = seg_starts.tolist()
    for i, slot in enumerate(seg_slots.tolist()):
        if slot < 0:
            continue
        a, b = starts[i], starts[i + 1]
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


class LoRALayerWeights:
    """One linear layer's adapter pool: ``lora_a [num_slots, R, in]`` and ``lora_b [num_slots,
    out, R]`` with ``R = num_shards * max_rank``, set and cleared one slot at a time."""

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
        self.shard_sizes = dict(shard_sizes)
        self.max_rank = max_rank
        self.context = context
        out_features = sum(self.shard_sizes.values())
        width = len(self.shard_sizes) * max_rank
        self.lora_a = torch.zeros((num_slots, width, in_features), dtype=dtype, device=device)
        self.lora_b = torch.zeros((num_slots, out_features, width), dtype=dtype, device=device)

    @property
    def active(self) -> bool:
        return self.context.batch is not None

    def set_slot(self, slot: int, shards: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Writes an adapter into ``slot``: per shard name, ``(A [r, in], B [rows, r])``, B already scaled."""
        self.clear_slot(slot)
        offset = 0
        for index, (name, rows) in enumerate(self.shard_sizes.items()):
            if name in shards:
                a, b = shards[name]
                rank = a.shape[0]
                if a.shape[1] != self.in_features or tuple(b.shape) != (rows, rank) or rank > self.max_rank:
                    raise ValueError(
                        f"LoRA shard {name or 'weight'}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit a layer of "
                        f"{self.in_features} inputs and {rows} outputs at rank <= {self.max_rank}"
                    )
                ranks = slice(index * self.max_rank, index * self.max_rank + rank)
                self.lora_a[slot, ranks] = a.to(self.lora_a.dtype)
                self.lora_b[slot, offset : offset + rows, ranks] = b.to(self.lora_b.dtype)
            offset += rows

    def clear_slot(self, slot: int) -> None:
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def add_delta(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """Adds this step's adapters' deltas to the base product ``y`` of ``x``, in place."""
        batch = self.context.batch
        if batch is not None:
            lora_shrink_expand(y, x, self.lora_a, self.lora_b, batch.seg_starts, batch.seg_slots)
