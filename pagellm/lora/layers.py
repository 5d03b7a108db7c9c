"""The layer side of LoRA: each adapted linear layer's pool of adapter weights, the per-step
segments of the flat batch (vLLM's PunicaWrapper metadata), and the one grouped product that adds
every segment's delta after the layer's base product (``ops.lora_shrink_expand``, Punica's
shrink/expand in the CPU kernels).

A fused projection (q/k/v, gate/up) keeps one pool per shard, so a step reads each adapter's B
once (a block-diagonal B over all shards would read zeros for the others), and a shard that no
loaded adapter targets is skipped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from pagellm.kernels.ops import lora_shrink_expand


@dataclass(frozen=True)
class LoRABatch:
    """One step's flat batch cut into runs of rows that use the same slot (-1: the base model)."""

    seg_starts: torch.Tensor  # int64 [S + 1]
    seg_slots: torch.Tensor  # int64 [S]
    slot_set: frozenset[int] = frozenset()  # the slots the segments use (no -1)

    def slots_only(self, keep: set[int]) -> torch.Tensor:
        """``seg_slots`` with every slot outside ``keep`` turned to -1 (those rows skip a layer)."""
        return torch.tensor([s if s in keep else -1 for s in self.seg_slots.tolist()], dtype=torch.int64)

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
        return LoRABatch(
            torch.tensor(starts, dtype=torch.int64),
            torch.tensor(seg_slots, dtype=torch.int64),
            frozenset(s for s in seg_slots if s >= 0),
        )


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
        """Whether this step adds a delta here: some row has an adapter, and some loaded adapter
        targets this layer (else a gate/up keeps its fused activation)."""
        batch = self.context.batch
        return batch is not None and any(batch.slot_set & pool.slots for pool in self.shards.values())

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
        used = batch.slot_set
        for pool in self.shards.values():
            targeted = used & pool.slots
            if not targeted:
                continue  # no adapter of this step targets the shard: nothing to read
            # Segments whose adapter leaves this shard alone skip it (their slots hold zeros here).
            seg_slots = batch.seg_slots if targeted == used else batch.slots_only(targeted)
            # Each shard's delta goes straight into its columns of the (fused) product.
            part = y if len(self.shards) == 1 else y[:, pool.offset : pool.offset + pool.rows]
            lora_shrink_expand(part, x, pool.lora_a, pool.lora_b, batch.seg_starts, seg_slots)
