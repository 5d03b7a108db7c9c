"""What the tests of the layers with a state slot per sequence (tests/layers/test_mamba2.py,
test_short_conv.py) share: a flat batch's state metadata, and a plan of chunks run through a layer
and gathered back per sequence."""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from pagellm.attention.state_metadata import StateMetadata

# (sequence's slot, its number of rows in the batch, whether it continues from the slot)
Chunk = tuple[int, int, bool]


def state_metadata(chunks: Sequence[Chunk], checkpoints: Sequence[tuple[int, int, int]] = ()) -> StateMetadata:
    """One flat batch of ``chunks`` in order, with checkpoint rows ``(i, o, s)``."""
    return StateMetadata(
        query_start_loc=torch.tensor([0] + [n for _, n, _ in chunks]).cumsum(0),
        slot_ids=torch.tensor([slot for slot, _, _ in chunks]),
        has_initial_state=torch.tensor([cont for _, _, cont in chunks]),
        checkpoints=torch.tensor(list(checkpoints), dtype=torch.int64).reshape(-1, 3),
    )


def run_chunk_plan(
    step: Callable[[torch.Tensor, list[Chunk]], torch.Tensor],
    sequences: Sequence[torch.Tensor],
    slots: Sequence[int],
    plan: Sequence[Sequence[int]],
) -> list[torch.Tensor]:
    """Each sequence's outputs over the plan's steps: step ``k`` runs ``plan[k][i]`` more rows of
    sequence ``i`` in slot ``slots[i]`` (continuing from it after its first rows) as one flat batch."""
    done = [0] * len(sequences)
    got: list[list[torch.Tensor]] = [[] for _ in sequences]
    for lengths in plan:
        rows = torch.cat([seq[done[i] : done[i] + n] for i, (seq, n) in enumerate(zip(sequences, lengths))])
        out = step(rows, [(slots[i], n, done[i] > 0) for i, n in enumerate(lengths)])
        for i, part in enumerate(out.split(list(lengths))):
            got[i].append(part)
            done[i] += lengths[i]
    assert done == [len(seq) for seq in sequences], "the plan must cover every sequence"
    return [torch.cat(parts) for parts in got]
