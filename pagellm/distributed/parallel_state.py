"""The tensor-parallel group of this process and its collectives.

A process that never joined a group (the default, single-process engine) has ``world_size`` 1
and every collective is the identity, so the model code calls them unconditionally.
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Optional

import torch


class TPGroup:
    def __init__(self, rank: int = 0, world_size: int = 1, group=None) -> None:
        self.rank = rank
        self.world_size = world_size
        self.group = group
        # Seconds spent in collectives (all-reduce, all-gather, broadcast) since the last reset.
        self.comm_s = 0.0
        self.num_all_reduce = 0

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sums ``t`` over the ranks, in place; returns it."""
        if self.world_size == 1:
            return t
        import torch.distributed as dist

        t0 = time.perf_counter()
        dist.all_reduce(t, group=self.group)
        self.comm_s += time.perf_counter() - t0
        self.num_all_reduce += 1
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's ``t`` (same shape on all) concatenated along ``dim``, in rank order."""
        if self.world_size == 1:
            return t
        import torch.distributed as dist

        t0 = time.perf_counter()
        t = t.contiguous()
        pieces = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(pieces, t, group=self.group)
        self.comm_s += time.perf_counter() - t0
        return torch.cat(pieces, dim=dim)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size == 1:
            return t
        import torch.distributed as dist

        t0 = time.perf_counter()
        dist.broadcast(t, src=src, group=self.group)
        self.comm_s += time.perf_counter() - t0
        return t


_TP = TPGroup()


def get_tp_group() -> TPGroup:
    return _TP


def init_tensor_parallel(
    rank: int, world_size: int, init_method: str, backend: Optional[str] = None, timeout_s: float = 600.0
) -> TPGroup:
    """Joins the process group (gloo on CPU, NCCL on CUDA) and makes it this process's TP group."""
    global _TP
    import torch.distributed as dist

    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s)
    )
    _TP = TPGroup(rank, world_size, dist.group.WORLD)
    return _TP


def destroy_tensor_parallel() -> None:
    global _TP
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _TP = TPGroup()
