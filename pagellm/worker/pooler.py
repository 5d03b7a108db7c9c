"""The pooling runner's math: one vector per prompt from the model's last hidden states.

The model returns hidden states after its final norm, one row per scheduled token. A pooling
request may be prefilled in several chunks (chunked prefill), so what a pooling type needs is
kept per request across steps: MEAN accumulates a float32 sum of every chunk's rows, CLS keeps
the first position's row, LAST needs only the chunk that ends the prompt. State dies with the
request's row (finished, aborted or preempted: a preempted request is recomputed from token 0).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from pagellm.pooling_params import POOLING_TYPES, PoolingParams
from pagellm.worker.input_batch import InputBatch


@dataclass(frozen=True)
class PoolingChunk:
    """One pooling request's part of a step: its rows ``[flat_start, flat_end)`` of the hidden
    states hold prompt positions ``[start, start + flat_end - flat_start)`` of ``num_prompt_tokens``."""

    req_id: str
    flat_start: int
    flat_end: int
    start: int
    num_prompt_tokens: int
    params: PoolingParams

    @property
    def finishes_prompt(self) -> bool:
        return self.start + self.flat_end - self.flat_start >= self.num_prompt_tokens


def pooling_chunks(
    batch: InputBatch, req_ids: list[str], rows: np.ndarray, start: np.ndarray, num_sched: np.ndarray, cu_end: np.ndarray
) -> list[PoolingChunk]:
    """The step's pooling requests (rows with pooling params), in batch order; the arrays are the step's, by batch position."""
    chunks = []
    for i, row in enumerate(rows.tolist()):
        p = batch.pooling_params[row]
        if p is not None:
            end = int(cu_end[i])
            chunks.append(PoolingChunk(req_ids[i], end - int(num_sched[i]), end, int(start[i]), int(batch.num_prompt_tokens[row]), p))
    return chunks


def finish_embeddings(pooled: torch.Tensor, params: list[PoolingParams]) -> list[list[float]]:
    """Matryoshka truncation to each request's ``dimensions``, then L2 normalization where asked."""
    out = []
    for row, p in zip(pooled, params):
        v = row[: p.dimensions] if p.dimensions is not None else row
        if p.normalize:
            v = F.normalize(v, p=2, dim=0)
        out.append(v.tolist())
    return out


class Pooler:
    """Per-request pooling state across a prompt's chunks; ``pool`` returns the finished vectors."""

    def __init__(self, pooling_type: str) -> None:
        if pooling_type not in POOLING_TYPES:
            raise ValueError(f"unsupported pooling_type {pooling_type!r}; choose one of {list(POOLING_TYPES)}")
        self.pooling_type = pooling_type
        # MEAN: sum of the rows seen so far; CLS: position 0's row. Float32 whatever the model's dtype.
        self._partial: dict[str, torch.Tensor] = {}

    def remove_request(self, req_id: str) -> None:
        self._partial.pop(req_id, None)

    @property
    def num_partial(self) -> int:
        """Requests part-way through their prompt, holding state here."""
        return len(self._partial)

    def pool(self, hidden: torch.Tensor, chunks: list[PoolingChunk]) -> dict[str, list[float]]:
        """Folds this step's rows in; the vectors of the requests whose prompt this step finished."""
        done: list[PoolingChunk] = []
        vectors: list[torch.Tensor] = []
        for c in chunks:
            vector = self._fold(hidden, c)
            if c.finishes_prompt:
                self._partial.pop(c.req_id, None)
                done.append(c)
                vectors.append(vector)
        if not done:
            return {}
        embeddings = finish_embeddings(torch.stack(vectors).float().cpu(), [c.params for c in done])
        return {c.req_id: e for c, e in zip(done, embeddings)}

    def _fold(self, hidden: torch.Tensor, c: PoolingChunk) -> Optional[torch.Tensor]:
        if self.pooling_type == "LAST":
            return hidden[c.flat_end - 1].float() if c.finishes_prompt else None
        if self.pooling_type == "CLS":
            if c.start == 0:
                # A copy: the hidden states may live in a buffer the next step overwrites (CUDA graphs).
                self._partial[c.req_id] = hidden[c.flat_start].float().clone()
            return self._require(c) if c.finishes_prompt else None
        rows = hidden[c.flat_start : c.flat_end].float().sum(dim=0)
        if c.start == 0:
            self._partial[c.req_id] = rows
        else:
            self._partial[c.req_id] = self._require(c) + rows
        return self._partial[c.req_id] / c.num_prompt_tokens if c.finishes_prompt else None

    def _require(self, c: PoolingChunk) -> torch.Tensor:
        partial = self._partial.get(c.req_id)
        if partial is None:
            # Only a prefix-cache hit starts a prompt past position 0, and the engine turns caching off for this type.
            raise RuntimeError(f"{self.pooling_type} pooling of {c.req_id!r} started at position {c.start}, not 0")
        return partial
