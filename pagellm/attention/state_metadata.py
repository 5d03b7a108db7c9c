"""What a step tells a hybrid model's recurrent layers (Gated DeltaNet, Mamba) about each sequence:
where its tokens lie in the flat batch, which state slot it reads and writes, whether it starts from
nothing, and where prefix caching wants its state saved (pagellm.core.state_cache). The recurrent
layers' counterpart of :class:`~pagellm.attention.backend.AttentionMetadata`, shared by all of them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateMetadata:
    query_start_loc: torch.Tensor  # int64 [N + 1], on the CPU: sequence i is rows [i, i + 1)
    slot_ids: torch.Tensor  # int64 [N]: each sequence's live state slot
    has_initial_state: torch.Tensor  # bool [N]: False starts from a zero state (a fresh prompt)
    # int64 [M, 3]: (sequence, tokens of this step, slot): after that many of the sequence's tokens
    # in this step, its state is also saved into that slot.
    checkpoints: torch.Tensor
    query_start_loc_cpu: tuple[int, ...] = ()

    @property
    def num_seqs(self) -> int:
        return self.slot_ids.shape[0]
