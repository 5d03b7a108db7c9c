"""The recurrent-state kernels' tests (test_recurrent.py, test_mamba.py): a flat batch's metadata
(semantics in pagellm/kernels/recurrent.py) with its slots shuffled and checkpoints into fresh slots."""
from __future__ import annotations

import torch


def batch_meta(lengths: list[int], num_slots: int, seed: int, checkpoint_offsets=None, cold_every: int = 2):
    """query_start_loc, slot_ids (distinct, shuffled), has_initial_state (False for every sequence
    ``i`` with ``i % cold_every == 1``) and checkpoints ``{sequence: [offsets]}`` into fresh slots."""
    gen = torch.Generator().manual_seed(seed)
    qsl = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    perm = torch.randperm(num_slots, generator=gen)
    slots = perm[: len(lengths)].to(torch.int64)
    has_init = torch.tensor([i % cold_every != 1 for i in range(len(lengths))])
    free = perm[len(lengths):].tolist()
    rows = [(i, o, free.pop()) for i, n in enumerate(lengths) for o in (checkpoint_offsets or {}).get(i, []) if 1 <= o <= n]
    return qsl, slots, has_init, torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)
