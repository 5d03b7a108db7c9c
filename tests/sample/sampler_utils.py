"""Builds SamplingMetadata for sampler tests from plain per-row values."""
from __future__ import annotations

from typing import Optional, Sequence, Union

import torch

from pagellm.sample.metadata import SamplingMetadata

Floats = Union[float, Sequence[float]]


def _per_row(value: Floats, num_rows: int) -> list[float]:
    return [float(value)] * num_rows if isinstance(value, (int, float)) else [float(v) for v in value]


def make_metadata(
    num_rows: int,
    *,
    temperature: Floats = 1.0,
    top_k: Optional[Sequence[int]] = None,
    top_p: Optional[Sequence[float]] = None,
    min_p: Optional[Sequence[float]] = None,
    seeds: Optional[dict[int, tuple[int, int]]] = None,
    presence: Optional[Sequence[float]] = None,
    frequency: Optional[Sequence[float]] = None,
    repetition: Optional[Sequence[float]] = None,
    output_token_ids: Optional[list[list[int]]] = None,
    prompt_token_ids: Optional[torch.Tensor] = None,
    bad_token_ids: Optional[dict[int, list[int]]] = None,
    logit_bias: Optional[dict[int, dict[int, float]]] = None,
    max_num_logprobs: Optional[int] = None,
) -> SamplingMetadata:
    temps = torch.tensor(_per_row(temperature, num_rows), dtype=torch.float32)
    greedy = temps < 1e-5
    use_penalties = presence is not None or frequency is not None or repetition is not None

    def opt(values: Optional[Sequence[float]], neutral: float) -> Optional[torch.Tensor]:
        if not use_penalties:
            return None
        return torch.tensor(values if values is not None else [neutral] * num_rows, dtype=torch.float32)

    return SamplingMetadata(
        temperature=temps,
        greedy_mask=greedy,
        all_greedy=bool(greedy.all()),
        all_random=not bool(greedy.any()),
        top_p=None if top_p is None else torch.tensor(top_p, dtype=torch.float32),
        top_k=None if top_k is None else torch.tensor(top_k, dtype=torch.int64),
        min_p=None if min_p is None else torch.tensor(min_p, dtype=torch.float32),
        seeds=seeds or {},
        presence_penalties=opt(presence, 0.0),
        frequency_penalties=opt(frequency, 0.0),
        repetition_penalties=opt(repetition, 1.0),
        output_token_ids=output_token_ids if output_token_ids is not None else [[] for _ in range(num_rows)],
        prompt_token_ids=prompt_token_ids,
        bad_token_ids=bad_token_ids or {},
        logit_bias=logit_bias or {},
        max_num_logprobs=max_num_logprobs,
    )
