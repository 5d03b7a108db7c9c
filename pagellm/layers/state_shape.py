"""What a recurrent layer keeps per request (its state tensors' shapes), as the layer states it for
the cache plan (pagellm.models.shape.ModelShape carries them; the KV cache layout allocates them)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateTensorShape:
    """One of a recurrent layer's state tensors, one per request (all ranks' heads): ``shape``
    with ``split_dim`` cut evenly across tensor-parallel ranks; ``ssm``: a recurrent matrix, which
    accumulates over the whole context, held in the SSM state dtype (float32 unless
    ``--mamba-ssm-cache-dtype`` or ``--mamba-cache-dtype`` says otherwise), else a convolution's input
    tail, in the activations' dtype unless ``--mamba-cache-dtype`` says otherwise."""

    shape: tuple[int, ...]
    split_dim: int
    ssm: bool
    # Runs of ``split_dim``, (units, elements per unit) each, that every rank holds whole when their
    # units do not divide over the ranks (a Mamba-2 layer's B and C groups, vLLM's rule).
    whole_if_indivisible: tuple[tuple[int, int], ...] = ()

    def per_rank(self, tp_size: int) -> tuple[int, ...]:
        runs = [units * size for units, size in self.whole_if_indivisible]
        rest = self.shape[self.split_dim] - sum(runs)
        if rest % tp_size:
            raise ValueError(f"a recurrent state of shape {self.shape} cannot be split {tp_size} ways along dim {self.split_dim}")
        held = rest // tp_size + sum(n // tp_size if units % tp_size == 0 else n for (units, _), n in zip(self.whole_if_indivisible, runs))
        return tuple(held if d == self.split_dim else n for d, n in enumerate(self.shape))

    def dtype(self, conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> torch.dtype:
        return ssm_dtype if self.ssm else conv_dtype

    def nbytes(self, conv_dtype: torch.dtype, ssm_dtype: torch.dtype, tp_size: int = 1) -> int:
        element = torch.empty((), dtype=self.dtype(conv_dtype, ssm_dtype)).element_size()
        return math.prod(self.per_rank(tp_size)) * element
