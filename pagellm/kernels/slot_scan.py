"""The torch references' walk over a flat batch of sequences and their state slots, shared by the
gated delta rule (:mod:`pagellm.kernels.recurrent`) and the Mamba-2 scan (:mod:`pagellm.kernels.mamba`).

The metadata (``query_start_loc``, ``slot_ids``, ``has_initial_state``, ``checkpoints``) is described
in :mod:`pagellm.kernels.recurrent`. A reference supplies only its math: one token for a batch of
states, and one chunk of one sequence; this module reads the initial states, cuts the chunks at the
checkpoint offsets and writes the final and checkpoint states.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

# (the states [n, ...] of n 1-token sequences, their token rows [n]) -> the states after the token;
# the step writes the tokens' outputs itself and may update the states in place.
DecodeStep = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# (the state before the chunk, the chunk's rows of the flat batch) -> the state after it.
ChunkStep = Callable[[torch.Tensor, slice], torch.Tensor]


def checkpoints_by_sequence(checkpoints: Optional[torch.Tensor], num_seqs: int) -> list[list[tuple[int, int]]]:
    """[(offset, dest slot), ...] per sequence, in offset order."""
    per_seq: list[list[tuple[int, int]]] = [[] for _ in range(num_seqs)]
    if checkpoints is not None and checkpoints.numel():
        for i, o, s in checkpoints.tolist():
            per_seq[i].append((o, s))
        for cps in per_seq:
            cps.sort()
    return per_seq


def scan_sequences(
    state: torch.Tensor,
    query_start_loc: torch.Tensor,
    slot_ids: torch.Tensor,
    has_initial_state: torch.Tensor,
    checkpoints: Optional[torch.Tensor],
    chunk_size: int,
    decode_step: DecodeStep,
    chunk_step: ChunkStep,
) -> None:
    """Runs every 1-token sequence through ``decode_step`` at once, then each longer one through
    ``chunk_step`` chunk by chunk (``chunk_size`` tokens, also cut at each checkpoint offset); writes
    each sequence's final state into its slot and each checkpoint's state into its slot. The steps see
    float32 states; a bfloat16 ``state`` is rounded only where it is written, as the kernels do."""
    starts = query_start_loc.tolist()
    slots = slot_ids.tolist()
    initial = has_initial_state.tolist()
    cps = checkpoints_by_sequence(checkpoints, len(slots))
    lengths = [starts[i + 1] - starts[i] for i in range(len(slots))]

    decodes = [i for i, n in enumerate(lengths) if n == 1]
    if decodes:
        rows = torch.tensor([starts[i] for i in decodes], device=state.device)
        dslots = torch.tensor([slots[i] for i in decodes], device=state.device)
        keep = torch.tensor([initial[i] for i in decodes], device=state.device)
        # One gathered float32 copy, zeroed for the sequences that start without a state.
        S = state.index_select(0, dslots).float().masked_fill_(~keep.view(-1, *([1] * (state.dim() - 1))), 0.0)
        state.index_copy_(0, dslots, decode_step(S, rows).to(state.dtype))
        for i in decodes:
            for _, s in cps[i]:
                state[s] = state[slots[i]]

    for i, n in enumerate(lengths):
        if n == 0 and not initial[i]:
            state[slots[i]] = 0.0
        if n <= 1:
            continue
        a = starts[i]
        S = state[slots[i]].to(torch.float32, copy=True) if initial[i] else state.new_zeros(state.shape[1:], dtype=torch.float32)
        cuts = sorted({o for o, _ in cps[i]} | set(range(chunk_size, n, chunk_size)) | {n})
        begin = 0
        for end in cuts:
            if end <= begin:
                continue
            S = chunk_step(S, slice(a + begin, a + end))
            for off, s in cps[i]:
                if off == end:
                    state[s] = S
            begin = end
        state[slots[i]] = S
